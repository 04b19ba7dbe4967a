//! Superseded rows, as one delivery meets them: a message that names its product
//! (`product_key`) asks Redis whether it is still its product's latest message when its
//! delivery begins, when it reserves a slot, and just before its call starts (see
//! [`crate::permit::Supersession`]). A superseded message finishes as `superseded` without a
//! call and gives back what it holds, unless its successor took its reservation over.

use tracing::{debug, warn};

use super::plan::{Outcome, Plan, Report, SUPERSEDED};
use super::{Carried, Interruptions, Worker, counting_redis_errors, until_done};
use crate::domain::{MessageId, Registration};
use crate::permit::{CALL_ALLOWANCE, Grant, ProductMessage, SupersedeStep, Supersession};

impl Worker {
    /// The product message `registration` is, if it names its product.
    pub(super) fn product_of<'a>(
        &self,
        registration: &'a Registration,
    ) -> Option<ProductMessage<'a>> {
        ProductMessage::of(registration, self.settings.done_ttl)
    }

    /// A delivery of a product's message begins: `Some` outcome if it is superseded (or was
    /// interrupted before Redis answered: it goes back to the broker). When it supersedes a
    /// message that held a reservation of its cost and route, it holds that reservation now.
    /// `noted` is the token of the reservation the product's record already has for it: its
    /// own (noted when it was made), none for one taken over (see [`Self::note_reserved`]).
    pub(super) async fn arrive(
        &self,
        registration: &Registration,
        product: &ProductMessage<'_>,
        carried: &mut Carried,
        noted: &mut Option<String>,
        interruptions: Interruptions<'_>,
    ) -> Option<Outcome> {
        let what = "could not ask whether the message is its product's latest";
        let held = carried.reservation.as_ref();
        let step = until_done(what, interruptions, || async move {
            counting_redis_errors(
                self.limiter
                    .supersede(product, SupersedeStep::Arrive, held)
                    .await,
            )
        })
        .await;
        match step {
            None => Some(Outcome::Requeue { holding: None }),
            Some(Supersession::Latest { took_over: None }) => {
                *noted = carried.reservation.as_ref().map(|r| r.token.clone());
                None
            }
            Some(Supersession::Latest {
                took_over: Some((from, reservation)),
            }) => {
                metrics::counter!("turnstile_reservations_taken_over_total").increment(1);
                debug!(
                    from = from.as_str(),
                    slot_us = reservation.slot_us,
                    "took over the reservation of the message it supersedes"
                );
                if let Some(own) = carried.reservation.take()
                    && own.token != reservation.token
                {
                    // A delivery that carried a reservation of its own (a copy, or a header
                    // someone wrote): one slot is enough.
                    self.unreserve_later(
                        registration.seller_id.clone(),
                        own,
                        registration.cost,
                        self.route_of(registration).cloned(),
                    );
                }
                carried.reservation = Some(reservation);
                None
            }
            Some(Supersession::Superseded {
                by,
                reservation_taken,
            }) => Some(self.superseded(registration, carried, by, reservation_taken)),
        }
    }

    /// The message now holds `carried`'s reservation, which its successor may take over (noted
    /// once per reservation, `noted` keeping the last one's token): `Some` outcome if it was
    /// superseded meanwhile. A failure to note it only means no successor can take it over.
    pub(super) async fn note_reserved(
        &self,
        registration: &Registration,
        product: &ProductMessage<'_>,
        carried: &mut Carried,
        noted: &mut Option<String>,
    ) -> Option<Outcome> {
        let reservation = carried.reservation.as_ref()?;
        if noted.as_deref() == Some(reservation.token.as_str()) {
            return None;
        }
        let step = self
            .limiter
            .supersede(product, SupersedeStep::Reserved(reservation), None)
            .await;
        match counting_redis_errors(step) {
            Ok(Supersession::Latest { .. }) => {
                *noted = Some(reservation.token.clone());
                None
            }
            Ok(Supersession::Superseded {
                by,
                reservation_taken,
            }) => Some(self.superseded(registration, carried, by, reservation_taken)),
            Err(error) => {
                debug!(%error, "the reservation was not noted for the product: a newer message cannot take it over");
                None
            }
        }
    }

    /// The call of a product's message under `grant` is about to start: `None` if it may (from
    /// now on it is never superseded), else what the message does instead, the grant to be
    /// given back by the caller: settle as superseded, ask again (the grant too old to call,
    /// before or after the step), or ask after a moment (Redis did not answer).
    pub(super) async fn start_product_call(
        &self,
        registration: &Registration,
        product: &ProductMessage<'_>,
        grant: &Grant,
        carried: &mut Carried,
    ) -> Option<Plan> {
        let late = || grant.sent().elapsed() > CALL_ALLOWANCE;
        if late() {
            carried.reservation = None;
            return Some(Plan::AskAgain);
        }
        let step = self
            .limiter
            .supersede(product, SupersedeStep::Start, carried.reservation.as_ref())
            .await;
        match counting_redis_errors(step) {
            Ok(Supersession::Latest { .. }) if late() => {
                // Too old to call by now: it may be superseded again.
                self.unstart_product_call(product).await;
                carried.reservation = None;
                Some(Plan::AskAgain)
            }
            Ok(Supersession::Latest { .. }) => None,
            // Its reservation was redeemed into the grant the caller gives back.
            Ok(Supersession::Superseded { by, .. }) => {
                carried.reservation = None;
                Some(Plan::Settle(self.superseded(
                    registration,
                    carried,
                    by,
                    true,
                )))
            }
            Err(error) => {
                warn!(%error, "could not say the call of a product's message starts (Redis): not calling yet");
                carried.reservation = None;
                Some(Plan::AskAfter(super::CLAIM_UNANSWERED_RECHECK))
            }
        }
    }

    /// No call followed a `start` that said the message may call (its grant was too old by
    /// then): it may be superseded again. A failure leaves it exempt (it proceeds as a message
    /// whose call started), which supersedes nothing wrongly.
    pub(super) async fn unstart_product_call(&self, product: &ProductMessage<'_>) {
        let step = self
            .limiter
            .supersede(product, SupersedeStep::Unstart, None)
            .await;
        if let Err(error) = counting_redis_errors(step) {
            debug!(%error, "a product's message that did not call could not be told so");
        }
    }

    /// The outcome of a superseded message: its reservation given back, unless its successor
    /// took it over (`taken`).
    fn superseded(
        &self,
        registration: &Registration,
        carried: &mut Carried,
        by: Option<MessageId>,
        taken: bool,
    ) -> Outcome {
        if let Some(reservation) = carried.reservation.take()
            && !taken
        {
            self.unreserve_later(
                registration.seller_id.clone(),
                reservation,
                registration.cost,
                self.route_of(registration).cloned(),
            );
        }
        metrics::counter!("turnstile_superseded_total").increment(1);
        // One detail for all, so that a listing groups them; the successor is in the result's
        // `superseded_by` and the dead letter's `x-turnstile-superseded-by`.
        let detail = "superseded by a newer message of its product".to_owned();
        debug!(by = by.as_ref().map(|m| m.as_str()), "superseded");
        Outcome::DeadLetter {
            reason: SUPERSEDED,
            detail,
            report: Report {
                superseded_by: by,
                ..Report::after(carried.attempt)
            },
        }
    }
}
