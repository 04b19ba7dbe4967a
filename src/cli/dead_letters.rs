//! `turnstile dead-letters`: list dead letters with their reasons, move chosen ones back to
//! the work queue, or discard them for good (or see, with a dry run, exactly which would).

use std::borrow::Cow;
use std::process::ExitCode;

use clap::Subcommand;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use turnstile_core::broker::dead_letters::{self, DeadLetter, Reason, Replayed, Selection};
use turnstile_core::broker::{BrokerArgs, Topology};
use turnstile_core::config::{LimiterArgs, RedisArgs};
use turnstile_core::domain::{BatchId, MessageId, SellerId};
use turnstile_core::permit::PermitStore;
use turnstile_core::replica::DoneTtlArgs;

use turnstile_ops::audit::Entry;

use super::{Json, Operator, batch_value, seller_value};

/// `turnstile dead-letters`: its action and the broker; `replay` also reads Redis (it counts
/// the messages it moves back as waiting again). No limiter setting is read.
#[derive(clap::Args, Debug)]
#[command(subcommand_precedence_over_arg = true)]
pub struct DeadLettersArgs {
    #[command(subcommand)]
    pub action: DeadLettersAction,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

#[derive(Subcommand, Debug)]
pub enum DeadLettersAction {
    /// List dead letters (all, or those the flags select) with their reasons, ids, attempts
    /// and the start of their bodies; they stay where they are.
    List {
        #[command(flatten)]
        select: Select,
        #[command(flatten)]
        json: Json,
    },
    /// Move dead letters (all, or those the flags select) back to the work queue, attempts
    /// reset; their messages count as waiting again in their uploads' progress. `--dry-run`
    /// shows exactly which would move, and moves nothing.
    Replay {
        #[command(flatten)]
        select: Select,
        /// Show the dead letters that would be replayed, and move nothing.
        #[arg(long = "dry-run")]
        dry_run: bool,
        /// Also replay superseded dead letters (a newer message of their product took their
        /// place): each becomes its product's latest message again. Without it they stay.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        done: DoneTtlArgs,
        #[command(flatten)]
        json: Json,
        #[command(flatten)]
        redis: RedisArgs,
        #[command(flatten)]
        operator: Operator,
    },
    /// Remove dead letters (all, or those the flags select) from the dead-letter queue for
    /// good: they are not republished, and their messages stay counted dead in their uploads.
    /// `--dry-run` shows exactly which would go, and removes nothing.
    Discard {
        #[command(flatten)]
        select: Select,
        /// Show the dead letters that would be discarded, and remove nothing.
        #[arg(long = "dry-run")]
        dry_run: bool,
        #[command(flatten)]
        json: Json,
        #[command(flatten)]
        redis: RedisArgs,
        #[command(flatten)]
        operator: Operator,
    },
}

/// Which dead letters an action takes: those matching every flag given.
#[derive(clap::Args, Clone, Debug)]
pub struct Select {
    /// Only the dead letters of this message id, as listed (every copy of it).
    #[arg(long, value_name = "MESSAGE_ID", value_parser = message_value)]
    pub id: Option<MessageId>,
    /// Only this seller's.
    #[arg(long, value_parser = seller_value)]
    pub seller: Option<SellerId>,
    /// Only this batch's (upload's).
    #[arg(long, value_parser = batch_value)]
    pub batch: Option<BatchId>,
    /// Only those dead for this reason.
    #[arg(long, value_parser = reason_value())]
    pub reason: Option<Reason>,
    /// Only those whose detail is exactly this (as `list` shows it).
    #[arg(long)]
    pub detail: Option<String>,
}

impl Select {
    /// The selection the flags make.
    pub fn selection(&self) -> Selection {
        Selection {
            message_id: self.id.as_ref().map(|m| m.as_str().to_owned()),
            seller_id: self.seller.as_ref().map(|s| s.as_str().to_owned()),
            batch_id: self.batch.as_ref().map(|b| b.as_str().to_owned()),
            reason: self.reason,
            detail: self.detail.clone().filter(|d| !d.trim().is_empty()),
            force: false,
        }
    }

    /// An audit entry of `action` on these dead letters by `operator`.
    fn audited(&self, action: &str, operator: &Operator, dry_run: bool) -> Entry {
        let mut entry = Entry::from_command_line(action, &operator.name());
        entry.seller = self.seller.as_ref().map(|s| s.as_str().to_owned());
        entry.batch = self.batch.as_ref().map(|b| b.as_str().to_owned());
        entry.message = self.id.as_ref().map(|m| m.as_str().to_owned());
        entry.argument = turnstile_ops::audit::dead_letters_argument(
            self.reason.map(Reason::as_str),
            self.detail.as_deref(),
        );
        entry.dry_run = dry_run;
        entry.outcome = "done".into();
        entry
    }
}

/// `--id`, parsed by clap.
fn message_value(s: &str) -> Result<MessageId, String> {
    MessageId::parse(s).map_err(|e| e.to_string())
}

/// `--reason`: one of [`Reason::ALL`], which `--help`, the completions and the error list.
fn reason_value() -> impl TypedValueParser<Value = Reason> {
    PossibleValuesParser::new(Reason::ALL.map(Reason::as_str)).try_map(|s| s.parse::<Reason>())
}

/// Runs `turnstile dead-letters`.
pub async fn run(DeadLettersArgs { action, broker }: DeadLettersArgs) -> anyhow::Result<ExitCode> {
    let opening = async {
        let (connection, publisher, topology) = broker.open("turnstile dead-letters").await?;
        let channel = connection.create_channel().await?;
        anyhow::Ok((connection, publisher, topology, channel))
    };
    let (connection, publisher, topology, channel) =
        tokio::time::timeout(dead_letters::STEP_TIMEOUT, opening)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "the broker did not open a session within {:?}",
                    dead_letters::STEP_TIMEOUT
                )
            })??;
    match action {
        DeadLettersAction::List { select, json } => {
            let selection = select.selection();
            let listing =
                dead_letters::list_page(&channel, &topology, &selection, 0, usize::MAX).await?;
            let letters = &listing.letters;
            if json.json {
                println!("{}", serde_json::to_string_pretty(letters)?);
            } else {
                println!(
                    "{} dead letters in {}{}",
                    letters.len(),
                    topology.dead(),
                    of(&selection)
                );
                print_groups(&listing);
                print_letters(letters);
                nothing_matched(letters.len() as u64, &selection);
            }
        }
        DeadLettersAction::Replay {
            select,
            dry_run,
            force,
            done,
            json,
            redis,
            operator,
        } => {
            let selection = select.selection().forced(force);
            let store = PermitStore::connect(&redis, &LimiterArgs::default()).await?;
            let done = dead_letters::replay(
                &channel, &publisher, &topology, &selection, &store, done.ttl, dry_run,
            )
            .await?;
            let mut entry = select.audited("replay", &operator, dry_run);
            entry.result = taken(
                "replay",
                dry_run,
                done.movable(),
                done.replayed,
                done.kept + done.refused,
            );
            entry.record(&store.records()).await;
            if json.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&replayed_json(&done, &topology))?
                );
            } else {
                print_replayed(&done, &topology, &selection);
            }
        }
        DeadLettersAction::Discard {
            select,
            dry_run,
            json,
            redis,
            operator,
        } => {
            let selection = select.selection();
            let store = PermitStore::connect(&redis, &LimiterArgs::default()).await?;
            let done =
                dead_letters::discard(&channel, &topology, &selection, dry_run, usize::MAX).await?;
            let mut entry = select.audited("discard", &operator, dry_run);
            entry.result = taken("discard", dry_run, done.matched, done.discarded, done.kept);
            entry.record(&store.records()).await;
            if json.json {
                let mut value = serde_json::json!(done);
                value["dead_queue"] = topology.dead().into();
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                if dry_run {
                    println!(
                        "would discard {} from {}{} (dry run: nothing removed); {} others stay",
                        done.matched,
                        topology.dead(),
                        of(&selection),
                        done.kept
                    );
                } else {
                    println!(
                        "discarded {} from {}{} (their messages stay counted dead); {} left",
                        done.discarded,
                        topology.dead(),
                        of(&selection),
                        done.kept
                    );
                }
                print_letters(&done.letters);
                nothing_matched(done.matched, &selection);
            }
        }
    }
    let closing = connection.close(200, "done".into());
    let _ = tokio::time::timeout(dead_letters::STEP_TIMEOUT, closing).await;
    Ok(ExitCode::SUCCESS)
}

/// The audit entry's result of a replay or discard: what a dry run would take of the
/// `matched`, or how many were taken; and how many stay.
fn taken(verb: &str, dry_run: bool, matched: u64, done: u64, kept: u64) -> String {
    if dry_run {
        format!("would {verb} {matched} (dry run); {kept} stay")
    } else {
        format!("{verb}ed {done}; {kept} left")
    }
}

/// ` (seller "S-1", reason rejected)`, or nothing for every dead letter.
fn of(selection: &Selection) -> String {
    if selection.is_all() {
        String::new()
    } else {
        format!(" ({})", printable(&selection.to_string()))
    }
}

/// Says on stderr that nothing matched (still a success: exit code 0).
fn nothing_matched(matched: u64, selection: &Selection) {
    if matched == 0 && !selection.is_all() {
        eprintln!(
            "no dead letter matches {}",
            printable(&selection.to_string())
        );
    }
}

/// `replay --json`: what it did (or on a dry run would do), the queues, and the letters.
fn replayed_json(done: &Replayed, topology: &Topology) -> serde_json::Value {
    let mut value = serde_json::json!(done);
    value["work_queue"] = topology.work().into();
    value["dead_queue"] = topology.dead().into();
    value
}

fn print_replayed(done: &Replayed, topology: &Topology, selection: &Selection) {
    if done.dry_run {
        println!(
            "would replay {} to {}{} (dry run: nothing moved); {} others stay in {}",
            done.movable(),
            topology.work(),
            of(selection),
            done.kept,
            topology.dead()
        );
    } else {
        println!(
            "replayed {} to {}{}; {} left in {}",
            done.replayed,
            topology.work(),
            of(selection),
            done.kept + done.refused,
            topology.dead()
        );
    }
    if done.refused > 0 {
        println!(
            "{} superseded dead letters stay in {} (a newer message of their product took their place; --force replays them too)",
            done.refused,
            topology.dead()
        );
    }
    print_letters(&done.letters);
    nothing_matched(done.matched, selection);
}

/// The dead letters by reason and detail, largest group first, when there is more than one
/// letter (`--detail` selects a group).
fn print_groups(listing: &dead_letters::Listing) {
    if listing.matched < 2 {
        return;
    }
    println!("by reason and detail (--reason and --detail select one):");
    for group in &listing.groups {
        println!(
            "  {:>6}  {:<18} {} seller(s)  {}",
            group.count,
            group.reason.as_str(),
            group.sellers,
            printable(&group.detail)
        );
    }
    if listing.other > 0 {
        println!("  {:>6}  in further groups", listing.other);
    }
    println!();
}

/// One line per dead letter, then its detail and the start of its body, indented.
fn print_letters(letters: &[DeadLetter]) {
    if letters.is_empty() {
        return;
    }
    println!(
        "{:<28} {:<16} {:<16} {:<18} {:>8}  {:<24}",
        "MESSAGE", "SELLER", "BATCH", "REASON", "ATTEMPTS", "DEAD AT"
    );
    for d in letters {
        let shown = |v: &Option<String>| printable(v.as_deref().unwrap_or("-")).into_owned();
        println!(
            "{:<28} {:<16} {:<16} {:<18} {:>8}  {:<24}",
            shown(&d.message_id),
            shown(&d.seller_id),
            shown(&d.batch_id),
            d.reason.as_str(),
            d.attempts.map_or("-".to_owned(), |a| a.to_string()),
            d.dead_at.as_deref().unwrap_or("-"),
        );
        if !d.detail.is_empty() {
            println!("    {}", printable(&d.detail));
        }
        println!(
            "    body ({} bytes): {}{}",
            d.bytes,
            printable(&d.body_excerpt),
            if d.body_truncated { "…" } else { "" }
        );
    }
}

/// Untrusted text made safe for a terminal: control characters and the invisible characters
/// that reorder or hide text (bidirectional overrides, zero-width) are shown escaped.
fn printable(text: &str) -> Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control()
            || matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}')
    };
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| {
                if unsafe_char(c) {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untrusted_text_cannot_drive_the_terminal() {
        assert_eq!(printable("plain S-1 größe"), "plain S-1 größe");
        assert!(matches!(printable("plain"), Cow::Borrowed(_)));
        assert_eq!(printable("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(printable("x\ny\r"), "x\\u{a}y\\u{d}");
        assert_eq!(printable("evil\u{202E}txt"), "evil\\u{202e}txt");
    }
}
