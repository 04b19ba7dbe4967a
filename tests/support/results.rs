//! The results a rig's replicas publish (`result.*` on its results exchange), as a test
//! collects them: listened to on a queue of the test's own, bound before anything is published.

use std::sync::{Arc, Mutex};

use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;
use serde_json::Value;
use turnstile_lab::rig::Rig;

/// Every result that came, in arrival order.
#[derive(Clone, Default)]
pub struct Results(Arc<Mutex<Vec<Value>>>);

impl Results {
    /// Listens to the rig's results exchange (bound before anything is published).
    pub async fn listen(rig: &Rig) -> Self {
        let results = Self::default();
        let inbox = results.0.clone();
        let queue = super::listen(rig.connection(), move |_, delivery| {
            if let Ok(result) = serde_json::from_slice::<Value>(&delivery.data) {
                inbox.lock().unwrap().push(result);
            }
        })
        .await;
        let channel = rig.connection().create_channel().await.unwrap();
        channel
            .queue_bind(
                queue.as_str().into(),
                rig.topology.results().as_str().into(),
                "result.*".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = channel.close(200, "bound".into()).await;
        results
    }

    pub fn all(&self) -> Vec<Value> {
        self.0.lock().unwrap().clone()
    }

    /// Each result as `<message_id>:<outcome>`, in order (for a failure's message).
    pub fn brief(&self) -> Vec<String> {
        self.all()
            .iter()
            .map(|r| {
                format!(
                    "{}:{}",
                    r["message_id"].as_str().unwrap_or("?"),
                    r["outcome"].as_str().unwrap_or("?")
                )
            })
            .collect()
    }

    /// The message ids of the results with `outcome`, in the order they came.
    pub fn with_outcome(&self, outcome: &str) -> Vec<String> {
        self.all()
            .iter()
            .filter(|r| r["outcome"] == outcome)
            .map(|r| r["message_id"].as_str().unwrap().to_owned())
            .collect()
    }

    pub async fn until(&self, n: usize) {
        super::eventually(&format!("{n} results"), || {
            self.0.lock().unwrap().len() >= n
        })
        .await;
    }
}
