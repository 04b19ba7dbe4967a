//! What moving dead letters back to the work queue records, as one narrow interface
//! ([`DeadLetterBook`]) that the broker's dead letters reach instead of the whole store: a
//! message counted as waiting again or as dead again, and the dead letters by reason.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::domain::{BatchSize, Identity, MessageId, SellerId};
use crate::permit::error::PermitError;
use crate::permit::outcome::{Completion, InBatch};
use crate::permit::store::PermitStore;
use crate::permit::supersession::ProductMessage;

/// The records a dead letter's replay changes (see `broker::dead_letters::replay`).
pub trait DeadLetterBook: Send + Sync {
    /// Counts a dead-lettered message as waiting again (its completion record goes from dead
    /// back to waiting, kept `ttl`); whether it was dead, so that this changed anything.
    fn revive<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        batch: Option<InBatch<'a>>,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, PermitError>>;

    /// Counts a message as dead again for `reason` (a replay whose republish failed).
    fn dead_again<'a>(
        &'a self,
        identity: &'a Identity,
        batch_size: Option<BatchSize>,
        reason: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>>;

    /// Makes a superseded message its product's latest again (a forced replay; see
    /// `lua/supersede.lua`'s `revive`); answers the latest before it.
    fn latest_again<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
    ) -> BoxFuture<'a, Result<Option<MessageId>, PermitError>>;

    /// Undoes [`Self::latest_again`] (its replay failed): `previous` is the latest again, unless
    /// another message became the latest since.
    fn latest_as_before<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
        previous: Option<&'a MessageId>,
    ) -> BoxFuture<'a, Result<(), PermitError>>;

    /// Moves the dead letters by reason by `by` for `reason` (a body without an identity is
    /// counted there per dead letter).
    fn tally_dead<'a>(&'a self, reason: &'a str, by: i64)
    -> BoxFuture<'a, Result<(), PermitError>>;
}

impl DeadLetterBook for PermitStore {
    fn revive<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        batch: Option<InBatch<'a>>,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, PermitError>> {
        async move {
            let recorded = self
                .complete(seller, message, batch, Completion::Replayed, ttl)
                .await?;
            Ok(recorded.changed)
        }
        .boxed()
    }

    fn dead_again<'a>(
        &'a self,
        identity: &'a Identity,
        batch_size: Option<BatchSize>,
        reason: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        async move {
            self.count_dead(identity, batch_size, reason, ttl).await?;
            Ok(())
        }
        .boxed()
    }

    fn latest_again<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
    ) -> BoxFuture<'a, Result<Option<MessageId>, PermitError>> {
        PermitStore::latest_again(self, message).boxed()
    }

    fn latest_as_before<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
        previous: Option<&'a MessageId>,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        PermitStore::latest_as_before(self, message, previous).boxed()
    }

    fn tally_dead<'a>(
        &'a self,
        reason: &'a str,
        by: i64,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        async move { self.records().tally_dead(reason, by).await }.boxed()
    }
}
