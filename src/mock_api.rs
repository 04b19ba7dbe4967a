//! `turnstile mock-api`: a strict stand-in for the registration API (being written).
