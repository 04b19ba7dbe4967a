//! Superseded rows: of one seller's messages for one product (their `product_key`), the latest
//! wins. Every replica asks `lua/supersede.lua` at three steps of a message's life: when a
//! delivery of it begins (`arrive`), when it reserved a slot (`reserved`), and just before its
//! call starts (`start`); an operator's forced replay makes it the latest again (`revive`). The
//! decision lives in Redis, so it holds across replicas, restarts and redeliveries; a message
//! whose call started is never superseded, since `start` marks it in the same step.

use std::time::Duration;

use crate::domain::{Cost, MessageId, ProductKey, Registration, RouteName, SellerId, Version};
use crate::permit::calls::{Supersede, SupersedeAnswer};
use crate::permit::decision::Reservation;
use crate::permit::error::PermitError;
use crate::permit::store::PermitStore;

/// One message of a product, as the supersession steps name it.
#[derive(Clone, Copy, Debug)]
pub struct ProductMessage<'a> {
    pub seller: &'a SellerId,
    pub product: &'a ProductKey,
    pub version: Option<Version>,
    pub message: &'a MessageId,
    /// Its cost and route: a newer message takes over an older one's reservation only when
    /// both are the same (the reservation holds units of that cost on that route's logs).
    pub cost: Cost,
    pub route: Option<&'a RouteName>,
    /// How long the product's record is kept after its last step (the completion records'
    /// TTL).
    pub ttl: Duration,
}

impl<'a> ProductMessage<'a> {
    /// `registration` as its product's steps name it, its record kept `ttl` (none without a
    /// `product_key`).
    pub fn of(registration: &'a Registration, ttl: Duration) -> Option<Self> {
        let (product, version) = registration.product_key.as_ref()?;
        Some(Self {
            seller: &registration.seller_id,
            product,
            version: *version,
            message: &registration.message_id,
            cost: registration.cost,
            route: registration.route.as_ref(),
            ttl,
        })
    }

    fn signature(&self) -> String {
        format!(
            "{}|{}",
            self.cost.units(),
            self.route.map_or("", |r| r.as_str())
        )
    }
}

/// A step of a product's message (see the module's documentation).
#[derive(Clone, Copy, Debug)]
pub enum SupersedeStep<'a> {
    /// A delivery of the message begins.
    Arrive,
    /// It reserved this slot, which a newer message may take over.
    Reserved(&'a Reservation),
    /// Its call is about to start: from now on it is never superseded.
    Start,
    /// No call followed a `Start` (the grant was too old by then): it may be superseded again.
    Unstart,
}

impl SupersedeStep<'_> {
    fn name(&self) -> &'static str {
        match self {
            Self::Arrive => "arrive",
            Self::Reserved(_) => "reserved",
            Self::Start => "start",
            Self::Unstart => "unstart",
        }
    }
}

/// What a step found.
#[derive(Clone, Debug, PartialEq)]
pub enum Supersession {
    /// The message is the latest of its product (or its call started): it proceeds. After
    /// `Arrive`, `took_over` is the reservation of the message it superseded, now its own
    /// (`None`: there was none to take).
    Latest {
        took_over: Option<(MessageId, Reservation)>,
    },
    /// A newer message (`by`) superseded it: it finishes as `superseded` without a call.
    /// `reservation_taken`: the newer message took over the reservation it holds, which it must
    /// then not give back.
    Superseded {
        by: Option<MessageId>,
        reservation_taken: bool,
    },
}

impl Supersession {
    fn of(answer: SupersedeAnswer) -> Self {
        let by = MessageId::parse(&answer.by).ok();
        if answer.superseded {
            return Self::Superseded {
                by,
                reservation_taken: answer.reservation == "taken",
            };
        }
        let took_over = by.zip(Reservation::decode(&answer.reservation));
        Self::Latest { took_over }
    }
}

impl PermitStore {
    /// One step of `message`, which holds the reservation `held` (see [`SupersedeStep`]).
    pub(crate) async fn supersede(
        &self,
        message: &ProductMessage<'_>,
        step: SupersedeStep<'_>,
        held: Option<&Reservation>,
    ) -> Result<Supersession, PermitError> {
        // The reservation `reserved` notes is the one the message holds.
        let (held, extra) = match step {
            SupersedeStep::Reserved(reservation) => (Some(reservation), reservation.encode()),
            _ => (held, String::new()),
        };
        let answer = self
            .supersede_step(message, step.name(), held.map(|r| r.token.as_str()), extra)
            .await?;
        Ok(Supersession::of(answer))
    }

    /// Makes `message` its product's latest again (an operator's forced replay); answers the
    /// latest before it, for [`Self::latest_as_before`] should the replay fail.
    pub(crate) async fn latest_again(
        &self,
        message: &ProductMessage<'_>,
    ) -> Result<Option<MessageId>, PermitError> {
        let answer = self
            .supersede_step(message, "revive", None, String::new())
            .await?;
        Ok(MessageId::parse(&answer.by).ok())
    }

    /// Undoes [`Self::latest_again`] when its replay failed: `previous` is the latest again,
    /// unless another message became the latest since.
    pub(crate) async fn latest_as_before(
        &self,
        message: &ProductMessage<'_>,
        previous: Option<&MessageId>,
    ) -> Result<(), PermitError> {
        let previous = previous.map_or_else(String::new, |p| p.as_str().to_owned());
        self.supersede_step(message, "unrevive", None, previous)
            .await?;
        Ok(())
    }

    async fn supersede_step(
        &self,
        message: &ProductMessage<'_>,
        step: &'static str,
        held: Option<&str>,
        extra: String,
    ) -> Result<SupersedeAnswer, PermitError> {
        let signature = message.signature();
        let call = Supersede {
            record: self.keys.product(message.seller, message.product),
            arrivals: self.keys.product_arrivals(message.seller, message.product),
            step,
            message: message.message.as_str(),
            version: message.version.map(Version::get),
            ttl_ms: message.ttl.as_millis() as u64,
            signature: &signature,
            held: held.unwrap_or(""),
            extra,
        };
        Ok(call
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?)
    }
}
