//! Typed scripts: one type per Lua script, which lays out its KEYS and ARGV by name in the
//! order the script's header lists them (flags that shift positions, such as ADAPTIVE, are
//! decided here, not by callers), and one per answer, which reads the script's reply.
//!
//! A call is written into anything that takes keys and arguments ([`Call`]): an operation of a
//! batch ([`Operation`]) or a plain script invocation. Each type's tests compare what it writes
//! with the KEYS and ARGV lines of its script's header.

mod acquire;
mod admin;
mod call;
mod complete;
mod ended;
mod fleet;
mod global;
mod learn;
mod lease;
mod records;
mod recost;
mod redeem;
mod release;
mod supersede;
mod unreserve;

pub(super) use acquire::{Acquire, AcquireAnswer, AcquireTail};
pub(super) use admin::{
    GlobalUsageCall, Pause, Reschedule, RescheduleAnswer, Reset, ResetAnswer, UsageCall,
};
#[cfg(test)]
pub(super) use call::header;
pub(super) use call::{AdaptiveKeys, Call, OnRoute};
pub(super) use complete::{AdaptiveArgs, Complete, CompleteAnswer, CompleteBatch};
pub(super) use ended::CallEnded;
pub(super) use fleet::{FleetAction, FleetAnswer, FleetCall};
pub(super) use global::{Global, GlobalAnswer, GlobalEnd};
pub(super) use learn::{Learn, LearnAnswer};
pub(super) use lease::{Lease, LeaseAnswer};
pub(super) use records::{BatchEventSent, BatchSeenCall, RetriesCall, RetryCall, Tally};
pub(super) use recost::{Recost, Recosted};
pub(super) use redeem::{Redeem, RedeemAnswer};
pub(super) use release::Release;
pub(super) use supersede::{Supersede, SupersedeAnswer};
pub(super) use unreserve::Unreserve;
