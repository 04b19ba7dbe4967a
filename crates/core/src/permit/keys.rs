//! Every Redis key turnstile uses, built in one place: nothing else formats a key.
//!
//! All keys start with the key prefix (`TURNSTILE_KEY_PREFIX`, no braces) and carry a Redis
//! Cluster hash tag (the text between the first `{` and the next `}`), which decides the hash
//! slot, hence the node, a key lives on:
//!
//! - **a seller's keys**: `<prefix>:{<seller tag>}:<name>`, the tag being
//!   [`SellerId::key_tag`] (the id percent-encoded: never `{`, `}`, `:` or `~`). Every key of a
//!   seller shares its slot, so one Lua script can read and write them all atomically, on one
//!   node, and sellers spread over the nodes. The scripts receive every key they touch in
//!   `KEYS` (none builds a key name itself).
//!   - the limiter state of the configured algorithm ([`Keyspace::state`]): `log`
//!     (sliding-window), `tat` (gcra), `bucket` (token-bucket) or `windows` (fixed-window);
//!   - `limit` (the seller's override), `pause`, `reserved:<algorithm>` (reserved slots), `server` (the
//!     stamp of the Redis that wrote the state), `calls` (calls in flight or recently
//!     answered), `far` (the far queue), `give-way` (how much its priority messages may still
//!     reorder its reservations), `learned` and `accepted` (adaptive limits),
//!     `shadow` and `shadow-log` (a shadow limit);
//!   - `route:<route>:log` and `route:<route>:limit`: a route's log and the seller's override of
//!     the route's stack (routes file; route names are letters, digits, `_` and `-` only);
//!   - `charge` and `route:<route>:charge`: the charge learned for the seller's calls on the
//!     default endpoint or a route (`TURNSTILE_COST_HEADER`);
//!   - `done:<message>`: a message's completion record; `batch:<batch>`: an upload's progress
//!     (message and batch ids percent-encoded as the seller's tag is); `retries`: its messages
//!     waiting out a retry's backoff (the ETA's only).
//! - **shared keys**: `<prefix>:{<prefix>~shared}:<name>`, one slot for all of them (a
//!   pipeline over several is one node's work). Their tag holds a `~`, which no seller's tag
//!   does, so they never land on a seller's tag: `sellers`, `uploads`, `dead-now`,
//!   `reschedules`, `throughput:<minute>`, `fleet` (the replicas' registry), `fleet-lost`
//!   (the replicas lost from it lately) and `fleet-algorithms`.
//! - **batch index keys**: `<prefix>:{<prefix>~batch~<batch>}:sellers`, the sellers whose
//!   messages named a batch, so that a batch is found by its id alone
//!   ([`Keyspace::batch_sellers`]), and `…:orphans`, its dead-lettered messages whose body
//!   named no seller, until a seller's message names the batch ([`Keyspace::batch_orphans`]);
//!   one slot per batch id.
//! - **global keys**: `<prefix>:{<prefix>~global}:<name>`, the global limit's state in one
//!   slot of its own (`lua/global.lua` takes them all): `log`, `fair`, `finish`, `active`,
//!   `weights`, `sellers`, `server`, `pause`.
//! - **loss markers**: `turnstile~losses:{~<n>}`, one per Redis Cluster hash slot (at most
//!   16384), shared by every key prefix on the server, without TTL: what the server lost
//!   (evicted or flushed keys) and since when, as first seen from that slot (`losses_since` in
//!   `lua/include/losses.lua`). `n` is chosen so that a seller's marker shares the seller's slot
//!   ([`Keyspace::losses`]). They describe the server, not a deployment, so they carry no
//!   prefix: a deployment under a new prefix must not take the server's past losses for new ones.
//! - **lab keys**: baselines the benchmarks write beside a seller's keys (`incr`, `baseline`).
//!
//! docs/redis-keys.md lists every key with its type, TTL, writers and readers.

use crate::config::Algorithm;
use crate::domain::{BatchId, MessageId, ProductKey, RouteName, SellerId, key_part};

/// The keys under one key prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyspace {
    prefix: String,
}

impl Keyspace {
    /// The keys under `prefix` (checked by the configuration: 1 to 64 characters, no braces).
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// What a replica writes to find out whether Redis takes `SET … NX … GET`:
    /// `<prefix>:probe:set-nx-get` (string, expires within a second; see
    /// `PermitStore::probe_set_nx_get`).
    pub fn set_nx_get_probe(&self) -> String {
        format!("{}:probe:set-nx-get", self.prefix)
    }

    /// A key of the seller's: `<prefix>:{<seller tag>}:<name>`.
    fn seller(&self, seller: &SellerId, name: &str) -> String {
        // Built by hand: a message's calls build a score of these keys each.
        let tag = seller.key_tag();
        let mut key = String::with_capacity(self.prefix.len() + tag.len() + name.len() + 4);
        for part in [self.prefix.as_str(), ":{", &tag, "}:", name] {
            key.push_str(part);
        }
        key
    }

    /// A key shared by all sellers and replicas: `<prefix>:{<prefix>~shared}:<name>`.
    fn shared(&self, name: &str) -> String {
        format!("{}:{{{}~shared}}:{}", self.prefix, self.prefix, name)
    }

    /// The seller's limiter state under `algorithm`: its log (sliding-window, sorted set), TAT
    /// (gcra, string), bucket (token-bucket, hash) or window counters (fixed-window, hash).
    pub fn state(&self, seller: &SellerId, algorithm: Algorithm) -> String {
        let name = match algorithm {
            Algorithm::SlidingWindow => "log",
            Algorithm::Gcra => "tat",
            Algorithm::TokenBucket => "bucket",
            Algorithm::FixedWindow => "windows",
        };
        self.seller(seller, name)
    }

    /// The seller's limit override (string `COUNT WINDOW_US`).
    pub fn limit(&self, seller: &SellerId) -> String {
        self.seller(seller, "limit")
    }

    /// The seller's log of a route's units (sorted set: the units of each call or reservation
    /// on the route, score = slot in µs; see `lua/include/routes.lua`).
    pub fn route_log(&self, seller: &SellerId, route: &RouteName) -> String {
        self.seller(seller, &format!("route:{route}:log"))
    }

    /// The seller's override of a route's stack (string "COUNTS WINDOWS_US", as the seller's
    /// own override; `turnstile limits set --seller S --route R`).
    pub fn route_limit(&self, seller: &SellerId, route: &RouteName) -> String {
        self.seller(seller, &format!("route:{route}:limit"))
    }

    /// The charge learned for the seller's calls on `route` (the default endpoint: `None`),
    /// from the costs their answers reported (string: an integer from 1 to 10,000, kept a while
    /// after the last answer that set or confirmed it; see `lua/include/charges.lua`):
    /// `charge`, `route:<route>:charge`.
    pub fn charge(&self, seller: &SellerId, route: Option<&RouteName>) -> String {
        match route {
            Some(route) => self.seller(seller, &format!("route:{route}:charge")),
            None => self.seller(seller, "charge"),
        }
    }

    /// The seller's pause (string: its end in µs, Redis time).
    pub fn pause(&self, seller: &SellerId) -> String {
        self.seller(seller, "pause")
    }

    /// The seller's slots reserved under `algorithm` (sorted set: member = `TOKEN+COST`, score
    /// = slot; see `held_name` in `lua/include/reservations.lua`), one set per algorithm: a slot
    /// reserved under one algorithm is counted only in its state, so another never grants it.
    pub fn reserved(&self, seller: &SellerId, algorithm: Algorithm) -> String {
        self.seller(seller, &format!("reserved:{algorithm}"))
    }

    /// The seller's server stamp: run id of the Redis that wrote its state (see
    /// `check_server` in `lua/include/losses.lua`).
    pub fn server(&self, seller: &SellerId) -> String {
        self.seller(seller, "server")
    }

    /// The loss marker of the seller's hash slot (see the module's doc).
    pub(crate) fn losses(&self, seller: &SellerId) -> String {
        losses_for(&self.server(seller))
    }

    /// The seller's calls in flight or answered within a window (sorted set: member = token,
    /// score = end; see `calls_gate` in `lua/include/calls.lua`).
    pub fn calls(&self, seller: &SellerId) -> String {
        self.seller(seller, "calls")
    }

    /// The seller's pool of permit-block units no call claimed yet (sorted set: unit -> its end
    /// in the seller's calls, µs; see `take_block` and `claim_idle` in
    /// `lua/include/blocks.lua`): an acquire or a replica's plain `ZPOPMIN` claims a unit by
    /// removing it, an acquire short of room and a change of terms take back the rest. (`pool`, not the previous version's
    /// `blocked`, whose units belonged to one replica: the two can run side by side during a
    /// rolling upgrade.)
    pub fn pool(&self, seller: &SellerId) -> String {
        self.seller(seller, "pool")
    }

    /// The seller's leases of calls in flight (sorted set: call token -> expiry µs; see
    /// `lua/lease.lua`).
    pub fn leases(&self, seller: &SellerId) -> String {
        self.seller(seller, "leases")
    }

    /// When the seller's next caller refused a lease comes back (string: µs).
    pub(crate) fn lease_ticket(&self, seller: &SellerId) -> String {
        self.seller(seller, "lease-ticket")
    }

    /// The seller's far queue (hash: `at`, `n`; see `far_ticket` in `lua/include/far.lua`).
    pub fn far(&self, seller: &SellerId) -> String {
        self.seller(seller, "far")
    }

    /// The seller's give-way budget (string: the Redis time in µs until which its steps are
    /// spent; see `give_way` in `lua/include/ranks.lua`).
    pub fn give_way(&self, seller: &SellerId) -> String {
        self.seller(seller, "give-way")
    }

    /// The seller's learned limit and the downstream's quota (hash; see `lua/learn.lua`).
    pub fn learned(&self, seller: &SellerId) -> String {
        self.seller(seller, "learned")
    }

    /// The units the downstream accepted of the seller within its longest window (sorted set;
    /// see `note_accepted` in `lua/include/learned.lua`).
    pub fn accepted(&self, seller: &SellerId) -> String {
        self.seller(seller, "accepted")
    }

    /// The seller's shadow limit and its verdicts (hash; see `judge_shadow` in
    /// `lua/include/shadow.lua`).
    pub fn shadow(&self, seller: &SellerId) -> String {
        self.seller(seller, "shadow")
    }

    /// The units granted to the seller, as the shadow limit judges them (sorted set).
    pub(crate) fn shadow_log(&self, seller: &SellerId) -> String {
        self.seller(seller, "shadow-log")
    }

    /// A message's completion record: `<prefix>:{<seller>}:done:<message>` (string, see
    /// `lua/complete.lua`).
    pub fn done(&self, seller: &SellerId, message: &MessageId) -> String {
        self.seller(seller, &format!("done:{}", key_part(message.as_str())))
    }

    /// The claim of a message's call: `<prefix>:{<seller>}:calling:<message>` (string: the token
    /// of the delivery that holds it, from its permit question to its call's bound; see
    /// [`super::Limiter::claim_call`]).
    pub fn calling(&self, seller: &SellerId, message: &MessageId) -> String {
        self.seller(seller, &format!("calling:{}", key_part(message.as_str())))
    }

    /// Which of a seller's messages for one product is the latest:
    /// `<prefix>:{<seller>}:product:<product_key>` (hash, see `lua/supersede.lua`).
    pub fn product(&self, seller: &SellerId, product: &ProductKey) -> String {
        self.seller(seller, &format!("product:{}", key_part(product.as_str())))
    }

    /// The messages of a product remembered, by arrival:
    /// `<prefix>:{<seller>}:product:<product_key>:arrivals` (sorted set, see
    /// `lua/supersede.lua`).
    pub fn product_arrivals(&self, seller: &SellerId, product: &ProductKey) -> String {
        self.seller(
            seller,
            &format!("product:{}:arrivals", key_part(product.as_str())),
        )
    }

    /// An upload's progress: `<prefix>:{<seller>}:batch:<batch>` (hash).
    pub fn batch(&self, seller: &SellerId, batch: &BatchId) -> String {
        self.seller(seller, &format!("batch:{}", key_part(batch.as_str())))
    }

    /// The seller's batches by when each was first seen (sorted set: batch id -> unix ms).
    pub fn seller_batches(&self, seller: &SellerId) -> String {
        self.seller(seller, "batches")
    }

    /// The seller's messages of a batch waiting out a retry's backoff, for the ETA only (sorted
    /// set: `COST:BATCH:MESSAGE` -> when the retry is due, Unix ms, Redis time; see
    /// `lua/retry.lua`).
    pub fn retries(&self, seller: &SellerId) -> String {
        self.seller(seller, "retries")
    }

    /// A glob pattern matching every upload's progress of the seller.
    pub(crate) fn batches_of(&self, seller: &SellerId) -> String {
        self.seller(seller, "batch:*")
    }

    /// A glob pattern matching every upload's progress under the prefix.
    pub fn batches(&self) -> String {
        format!("{}:*:batch:*", self.prefix)
    }

    /// A glob pattern matching every completion record under the prefix.
    pub fn completion_records(&self) -> String {
        format!("{}:*:done:*", self.prefix)
    }

    /// A glob pattern matching every key under the prefix (for cleanup and weighing).
    pub fn everything(&self) -> String {
        format!("{}:*", self.prefix)
    }

    /// Sellers any replica asked permits for recently (sorted set: seller id -> last unix ms).
    pub fn sellers_seen(&self) -> String {
        self.shared("sellers")
    }

    /// The sellers whose messages named a batch (set of seller ids), so that a batch is found
    /// by its id alone: `<prefix>:{<prefix>~batch~<batch>}:sellers`, in a slot of its own (its
    /// tag holds a `~`, which no seller's tag does).
    pub(crate) fn batch_sellers(&self, batch: &BatchId) -> String {
        format!(
            "{}:{{{}~batch~{}}}:sellers",
            self.prefix,
            self.prefix,
            key_part(batch.as_str())
        )
    }

    /// A batch's dead-lettered messages whose body named the batch and a message id but no
    /// seller, kept until a seller's message names the batch, to be counted in that seller's
    /// batch (set of `<reason> <message id>`): `<prefix>:{<prefix>~batch~<batch>}:orphans`, in
    /// the slot of [`Self::batch_sellers`].
    pub(crate) fn batch_orphans(&self, batch: &BatchId) -> String {
        format!(
            "{}:{{{}~batch~{}}}:orphans",
            self.prefix,
            self.prefix,
            key_part(batch.as_str())
        )
    }

    /// The index of batches by when they were first seen (sorted set: batch key -> unix ms).
    pub fn uploads(&self) -> String {
        self.shared("uploads")
    }

    /// Messages dead now, by reason (hash: reason -> count). Named anew: `dead-letters`, its
    /// predecessor, counted every dead letter and was never lowered.
    pub fn dead_now(&self) -> String {
        self.shared("dead-now")
    }

    /// The fleet's registry (hash: replica id -> its entry; see `lua/fleet.lua`).
    pub fn fleet(&self) -> String {
        self.shared("fleet")
    }

    /// The replicas lost from the fleet's registry lately: their entries expired unrenewed
    /// (hash: replica id -> when, and its last entry; see `lua/fleet.lua`).
    pub(crate) fn fleet_lost(&self) -> String {
        self.shared("fleet-lost")
    }

    /// The replicas that left the fleet lately (hash: replica id -> when; see `lua/fleet.lua`).
    pub(crate) fn fleet_left(&self) -> String {
        self.shared("fleet-left")
    }

    /// The algorithms the fleet granted under, with when each was last used (hash; see
    /// `lua/fleet.lua`).
    pub(crate) fn fleet_algorithms(&self) -> String {
        self.shared("fleet-algorithms")
    }

    /// The log of reschedules (sorted set: seller id -> when its terms changed, Redis µs).
    pub fn reschedules(&self) -> String {
        self.shared("reschedules")
    }

    /// The operators' recent actions from the dashboard (list of JSON entries, newest first;
    /// see [`super::Records::note_action`]).
    pub fn actions(&self) -> String {
        self.shared("actions")
    }

    /// Registrations in the unix minute `minute` (hash: unix second -> count).
    pub fn throughput(&self, minute: u64) -> String {
        self.shared(&format!("throughput:{minute}"))
    }

    /// What the replica `replica` (its id in the fleet) holds in its delay ladder, by seller
    /// (hash: seller -> its [`crate::broker::ladder::HeldSummary`] as JSON).
    pub fn held_by(&self, replica: &str) -> String {
        self.shared(&format!("held:{replica}"))
    }

    /// What the replicas did in each minute of the unix hour `hour` (hash: `<minute>:<what>`
    /// -> count, `what` one of [`crate::permit::History`]'s rates).
    pub fn history(&self, hour: u64) -> String {
        self.shared(&format!("history:{hour}"))
    }

    /// A key of the global limit's: `<prefix>:{<prefix>~global}:<name>`, one slot for all of
    /// them (one script reads and writes them atomically), apart from the shared keys' slot.
    fn global(&self, name: &str) -> String {
        format!("{}:{{{}~global}}:{}", self.prefix, self.prefix, name)
    }

    /// The global limit's log (sorted set: `<unit>|<seller tag>` -> grant µs; see
    /// `lua/global.lua`).
    pub fn global_log(&self) -> String {
        self.global("log")
    }

    /// The global fair state (hash: `v` = virtual time, `w` = the active sellers' weights).
    pub fn global_fair(&self) -> String {
        self.global("fair")
    }

    /// The active sellers' finish tags (sorted set: seller tag -> virtual finish).
    pub fn global_finish(&self) -> String {
        self.global("finish")
    }

    /// The active sellers (sorted set: seller tag -> active until, µs).
    pub fn global_active(&self) -> String {
        self.global("active")
    }

    /// The sellers' weights under the global limit (hash: seller tag -> weight; absent = 1).
    pub(crate) fn global_weights(&self) -> String {
        self.global("weights")
    }

    /// The active sellers' tickets and weights (hash: `t|<seller tag>`, `w|<seller tag>`).
    pub fn global_sellers(&self) -> String {
        self.global("sellers")
    }

    /// Every key of the global limit, in the order `lua/global.lua` takes them: then the
    /// stamp of the Redis that wrote the global state (`server`) and the global pause (`pause`;
    /// see `check_server` in `lua/include/losses.lua`).
    pub fn global_keys(&self) -> [String; 9] {
        [
            self.global_log(),
            self.global_fair(),
            self.global_finish(),
            self.global_active(),
            self.global_weights(),
            self.global_sellers(),
            self.global("server"),
            self.global("pause"),
            losses_for(&self.global("server")),
        ]
    }

    /// The lab's baseline counter beside the seller's keys (`turnstile bench permits`: a plain
    /// INCR to compare a permit with).
    pub fn lab_incr(&self, seller: &SellerId) -> String {
        self.seller(seller, "incr")
    }

    /// The lab's baseline string beside the seller's keys (`turnstile bench sellers`: a plain
    /// SET to compare a seller's memory with).
    pub fn lab_baseline(&self, seller: &SellerId) -> String {
        self.seller(seller, "baseline")
    }
}

/// The part of `key` Redis Cluster hashes: the text between the first `{` and the next `}` if
/// it is not empty, else the whole key (keys with the same tag share a slot).
pub(crate) fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// The loss marker in the hash slot of `key` (see the module's doc).
pub(crate) fn losses_for(key: &str) -> String {
    format!(
        "turnstile~losses:{{~{}}}",
        marker_tags()[usize::from(slot(key))]
    )
}

/// The Redis Cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag (the text between the
/// first `{` and the next `}`, if not empty; else the whole key), mod 16384.
pub fn slot(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key).as_bytes()) % 16384
}

/// For each hash slot, the least `n` whose tag `~<n>` lies in it (found once, in a few ms).
fn marker_tags() -> &'static [u32] {
    static TAGS: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; 16384];
        let mut missing = tags.len();
        let mut n = 0u32;
        while missing > 0 {
            let at = usize::from(slot(&format!("{{~{n}}}")));
            if tags[at] == u32::MAX {
                tags[at] = n;
                missing -= 1;
            }
            n += 1;
        }
        tags
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_tag_is_the_text_between_the_first_braces() {
        assert_eq!(hash_tag("p:{seller-1}:log"), "seller-1");
        assert_eq!(hash_tag("p:{}:log"), "p:{}:log");
        assert_eq!(hash_tag("p:log"), "p:log");
        assert_eq!(hash_tag("p:{a}{b}"), "a");
        assert_eq!(hash_tag("p:{open"), "p:{open");
    }

    fn seller(s: &str) -> SellerId {
        SellerId::parse(s).unwrap()
    }

    /// Every key of a seller's the keyspace builds.
    fn seller_keys(keys: &Keyspace, s: &SellerId) -> Vec<String> {
        let mut all: Vec<String> = Algorithm::ALL
            .into_iter()
            .flat_map(|a| [keys.state(s, a), keys.reserved(s, a)])
            .collect();
        all.extend([
            keys.limit(s),
            keys.pause(s),
            keys.server(s),
            keys.calls(s),
            keys.pool(s),
            keys.far(s),
            keys.give_way(s),
            keys.leases(s),
            keys.lease_ticket(s),
            keys.learned(s),
            keys.accepted(s),
            keys.shadow(s),
            keys.shadow_log(s),
            keys.done(s, &MessageId::parse("m:{1}").unwrap()),
            keys.batch(s, &BatchId::parse("b 1").unwrap()),
            keys.seller_batches(s),
            keys.retries(s),
            keys.lab_incr(s),
            keys.lab_baseline(s),
            keys.route_log(s, &RouteName::parse("price-2_x").unwrap()),
            keys.route_limit(s, &RouteName::parse("price-2_x").unwrap()),
            keys.charge(s, None),
            keys.charge(s, Some(&RouteName::parse("price-2_x").unwrap())),
        ]);
        all
    }

    fn shared_keys(keys: &Keyspace) -> Vec<String> {
        vec![
            keys.sellers_seen(),
            keys.uploads(),
            keys.dead_now(),
            keys.reschedules(),
            keys.actions(),
            keys.fleet(),
            keys.fleet_lost(),
            keys.fleet_left(),
            keys.fleet_algorithms(),
            keys.throughput(29_000_000),
        ]
    }

    #[test]
    fn the_slot_is_the_one_redis_computes() {
        // CLUSTER KEYSLOT answers these (Redis Cluster specification).
        assert_eq!(slot("123456789"), 12739);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(hash_tag("foo{}{bar}"), "foo{}{bar}");
    }

    #[test]
    fn keys_keep_their_names() {
        let keys = Keyspace::new("turnstile");
        let s = seller("S-1");
        assert_eq!(
            keys.state(&s, Algorithm::SlidingWindow),
            "turnstile:{S-1}:log"
        );
        assert_eq!(keys.state(&s, Algorithm::Gcra), "turnstile:{S-1}:tat");
        assert_eq!(
            keys.state(&s, Algorithm::TokenBucket),
            "turnstile:{S-1}:bucket"
        );
        assert_eq!(
            keys.state(&s, Algorithm::FixedWindow),
            "turnstile:{S-1}:windows"
        );
        assert_eq!(keys.limit(&s), "turnstile:{S-1}:limit");
        assert_eq!(keys.pause(&s), "turnstile:{S-1}:pause");
        assert_eq!(
            keys.reserved(&s, Algorithm::Gcra),
            "turnstile:{S-1}:reserved:gcra"
        );
        assert_eq!(keys.server(&s), "turnstile:{S-1}:server");
        assert_eq!(keys.give_way(&s), "turnstile:{S-1}:give-way");
        assert_eq!(keys.calls(&s), "turnstile:{S-1}:calls");
        assert_eq!(keys.pool(&s), "turnstile:{S-1}:pool");
        assert_eq!(keys.far(&s), "turnstile:{S-1}:far");
        assert_eq!(keys.charge(&s, None), "turnstile:{S-1}:charge");
        assert_eq!(
            keys.charge(&s, Some(&RouteName::parse("price").unwrap())),
            "turnstile:{S-1}:route:price:charge"
        );
        assert_eq!(
            keys.done(&s, &MessageId::parse("m 1").unwrap()),
            "turnstile:{S-1}:done:m%201"
        );
        assert_eq!(
            keys.batch(&s, &BatchId::parse("b:1").unwrap()),
            "turnstile:{S-1}:batch:b%3A1"
        );
        assert_eq!(keys.retries(&s), "turnstile:{S-1}:retries");
        assert_eq!(keys.batches_of(&s), "turnstile:{S-1}:batch:*");
        assert_eq!(keys.batches(), "turnstile:*:batch:*");
        assert_eq!(keys.completion_records(), "turnstile:*:done:*");
        assert_eq!(keys.everything(), "turnstile:*");
        assert_eq!(keys.sellers_seen(), "turnstile:{turnstile~shared}:sellers");
        assert_eq!(keys.uploads(), "turnstile:{turnstile~shared}:uploads");
        assert_eq!(
            keys.batch_sellers(&BatchId::parse("b:1").unwrap()),
            "turnstile:{turnstile~batch~b%3A1}:sellers"
        );
        assert_eq!(
            keys.batch_orphans(&BatchId::parse("b:1").unwrap()),
            "turnstile:{turnstile~batch~b%3A1}:orphans"
        );
        assert_eq!(keys.dead_now(), "turnstile:{turnstile~shared}:dead-now");
        assert_eq!(
            keys.reschedules(),
            "turnstile:{turnstile~shared}:reschedules"
        );
        assert_eq!(
            keys.throughput(12),
            "turnstile:{turnstile~shared}:throughput:12"
        );
        assert_eq!(keys.fleet(), "turnstile:{turnstile~shared}:fleet");
        assert_eq!(keys.fleet_lost(), "turnstile:{turnstile~shared}:fleet-lost");
        assert_eq!(keys.lab_incr(&s), "turnstile:{S-1}:incr");
        assert_eq!(keys.lab_baseline(&s), "turnstile:{S-1}:baseline");
    }

    #[test]
    fn a_sellers_keys_share_one_slot_under_its_tag() {
        let keys = Keyspace::new("turn:stile");
        for id in ["S-1", "größe", "{brace}", "a:b", "turn:stile~shared", "%7B"] {
            let s = seller(id);
            for key in seller_keys(&keys, &s) {
                assert!(key.starts_with("turn:stile:"), "{key}");
                assert_eq!(hash_tag(&key), s.key_tag(), "{key}");
                assert_eq!(slot(&key), slot(&keys.limit(&s)), "{key}");
            }
        }
    }

    #[test]
    fn shared_keys_share_one_slot_and_never_a_sellers_tag() {
        for prefix in ["turnstile", "t~x", "a.b-c"] {
            let keys = Keyspace::new(prefix);
            let shared = shared_keys(&keys);
            let tag = format!("{prefix}~shared");
            for key in &shared {
                assert!(key.starts_with(&format!("{prefix}:")), "{key}");
                assert_eq!(hash_tag(key), tag, "{key}");
            }
            // Not even a seller named after the shared tag lands on it.
            for id in [tag.as_str(), &format!("{{{tag}}}"), prefix, "S-1"] {
                let s = seller(id);
                for key in seller_keys(&keys, &s) {
                    assert_ne!(hash_tag(&key), tag, "{key}");
                    assert!(!shared.contains(&key), "{key}");
                }
            }
        }
    }

    #[test]
    fn a_loss_marker_shares_the_slot_of_its_key_and_no_sellers_tag() {
        let keys = Keyspace::new("turnstile");
        for s in ["S-1", "S-2", "{x}", "Händler:7", "~"] {
            let s = seller(s);
            let marker = keys.losses(&s);
            assert_eq!(slot(&marker), slot(&keys.server(&s)), "{marker}");
            assert!(hash_tag(&marker).starts_with('~'), "{marker}");
        }
        // One marker per slot, whatever the prefix.
        assert_eq!(
            keys.losses(&seller("S-1")),
            Keyspace::new("other").losses(&seller("S-1"))
        );
        let global = keys.global_keys();
        assert_eq!(slot(&global[8]), slot(&global[0]));
    }

    #[test]
    fn global_keys_share_one_slot_of_their_own() {
        for prefix in ["turnstile", "t~x"] {
            let keys = Keyspace::new(prefix);
            let tag = format!("{prefix}~global");
            for key in &keys.global_keys()[..8] {
                assert!(key.starts_with(&format!("{prefix}:")), "{key}");
                assert_eq!(hash_tag(key), tag, "{key}");
                assert!(!shared_keys(&keys).contains(key), "{key}");
            }
            for key in seller_keys(&keys, &seller(&tag)) {
                assert_ne!(hash_tag(&key), tag, "{key}");
            }
        }
    }

    #[test]
    fn patterns_match_the_keys_they_name() {
        // The glob patterns only use `*`: match it as a prefix/suffix split.
        fn matches(pattern: &str, key: &str) -> bool {
            let parts: Vec<&str> = pattern.split('*').collect();
            let mut rest = key;
            for (i, part) in parts.iter().enumerate() {
                if i == 0 {
                    let Some(r) = rest.strip_prefix(part) else {
                        return false;
                    };
                    rest = r;
                } else if i == parts.len() - 1 {
                    return rest.ends_with(part);
                } else {
                    let Some(at) = rest.find(part) else {
                        return false;
                    };
                    rest = &rest[at + part.len()..];
                }
            }
            rest.is_empty()
        }
        let keys = Keyspace::new("turnstile");
        let (s, other) = (seller("S-1"), seller("S-2"));
        let batch = keys.batch(&s, &BatchId::parse("b1").unwrap());
        let done = keys.done(&s, &MessageId::parse("m1").unwrap());
        assert!(matches(&keys.batches_of(&s), &batch));
        assert!(!matches(&keys.batches_of(&other), &batch));
        assert!(matches(&keys.batches(), &batch));
        assert!(!matches(&keys.batches(), &done));
        assert!(matches(&keys.completion_records(), &done));
        assert!(!matches(&keys.completion_records(), &batch));
        for key in seller_keys(&keys, &s).iter().chain(&shared_keys(&keys)) {
            assert!(matches(&keys.everything(), key), "{key}");
            assert!(!matches(&Keyspace::new("turnstile-2").everything(), key));
        }
    }
}
