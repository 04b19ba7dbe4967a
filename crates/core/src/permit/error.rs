//! What a permit decision can fail with, and which failures asking again may cure.

/// A failed permit decision: the caller cannot know whether it may call, so it must not.
#[derive(Debug, thiserror::Error)]
pub enum PermitError {
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected answer from the {0} script")]
    Answer(&'static str),
    /// A script refused an operation of a batch (see `lua/batch.lua`): its inputs, or a
    /// command inside it failed.
    #[error("Redis refused: {0}")]
    Refused(String),
    /// The fleet's terms could not be confirmed (see [`applied`]): waited out.
    #[error("{0}")]
    Fleet(&'static str),
}

impl PermitError {
    /// Whether asking again later can succeed. Only a script's own refusal (an error it raises
    /// with `ERR turnstile: …`, for inputs it rejects) and an answer of the wrong shape are
    /// final: every other error (Redis unreachable or timing out, and every server error such
    /// as OOM, MISCONF, READONLY, BUSY, LOADING, NOREPLICAS, CLUSTERDOWN, TRYAGAIN, even inside a
    /// batch) says nothing about the request, so the caller waits and asks again.
    pub fn is_transient(&self) -> bool {
        match self {
            PermitError::Redis(error) => !is_final(error),
            PermitError::Refused(why) => !is_own_refusal(why),
            PermitError::Answer(_) => false,
            PermitError::Fleet(_) => true,
        }
    }
}

/// The prefix of every error a script raises itself (see `lua/include/args.lua`).
const OWN_REFUSAL: &str = "ERR turnstile:";

/// Whether an error a batch operation raised is a script's own refusal (not a server error).
fn is_own_refusal(why: &str) -> bool {
    why.starts_with(OWN_REFUSAL)
}

/// Whether a Redis error is final: a script's own refusal, or an answer that does not convert.
fn is_final(error: &redis::RedisError) -> bool {
    let own = error.code() == Some("ERR")
        && error
            .detail()
            .is_some_and(|d| d.starts_with(&OWN_REFUSAL["ERR ".len()..]));
    own || error.kind() == redis::ErrorKind::UnexpectedReturnType
}
