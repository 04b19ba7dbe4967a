//! The ids an operator's request names, parsed as a message body's are.

use turnstile_core::domain::{BatchId, MessageId, SellerId};

/// A seller id as the message body's is parsed.
pub(crate) fn seller_id(s: &str) -> Result<SellerId, String> {
    SellerId::parse(s).map_err(|e| format!("seller {s:?}: {e}"))
}

/// A batch id as the message body's is parsed.
pub(crate) fn batch_id(s: &str) -> Result<BatchId, String> {
    BatchId::parse(s).map_err(|e| format!("batch {s:?}: {e}"))
}

/// A message id as the message body's is parsed.
pub(crate) fn message_id(s: &str) -> Result<MessageId, String> {
    MessageId::parse(s).map_err(|e| format!("message {s:?}: {e}"))
}
