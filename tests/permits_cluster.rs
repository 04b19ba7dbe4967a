//! The permit engine against a local 3-node Redis Cluster, with sellers on every node.
mod support;

use support::asks::decide;
use support::{Backend, cluster};
use turnstile_core::permit::{Ask, Decision};

permit_tests!(Backend::Cluster);

#[tokio::test]
async fn sellers_spread_over_all_three_nodes_each_get_their_own_limit() {
    let keys = support::Keys::new(Backend::Cluster, "spread").await;
    let store = keys.store(support::limiter(
        "1/1h",
        turnstile_core::config::Algorithm::SlidingWindow,
    ));
    let mut nodes = std::collections::BTreeSet::new();
    for i in 0..30 {
        let seller = turnstile_core::domain::SellerId::parse(&format!("S-{i}")).unwrap();
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(
                store
                    .keys()
                    .state(&seller, turnstile_core::config::Algorithm::SlidingWindow),
            )
            .query_async(&mut keys.conn.clone())
            .await
            .unwrap();
        nodes.insert(slot / 5462);
        let ask = Ask::new(&seller).without_reserving();
        assert!(matches!(
            decide(&store, ask).await,
            Decision::Granted { .. }
        ));
        assert!(matches!(decide(&store, ask).await, Decision::Wait { .. }));
    }
    assert_eq!(
        nodes.len(),
        cluster::PORTS.len(),
        "sellers did not reach every node"
    );
    keys.cleanup().await;
}
