//! Reading uploads (.xlsx, .csv, .jsonl) into registration messages (being written).
