//! Routes: several endpoints of one provider under one budget per seller.
//!
//! A routes file (`TURNSTILE_ROUTES_FILE`, TOML) names each route's method, URL template, its
//! own per-seller limit stack and default cost. A message's optional `route` picks one; its call
//! then takes units of the route's stack and of the seller's budget (`TURNSTILE_LIMIT` or the
//! seller's override) in one atomic step (`lua/include/routes.lua`). Without the file, every
//! message calls `TURNSTILE_DOWNSTREAM_URL` as before, and a message naming a route is
//! dead-lettered as `invalid-message`, as is one naming a route the file does not have.
//!
//! A route, or the default endpoint (a `[default]` table), may be bulk ([`Bulk`]): one call
//! carries several messages of one seller (see `worker::bulk` for how they are gathered and
//! `downstream::bulk` for the request and how its answer maps back to each row).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::config::{Limits, UrlTemplate, UrlTemplateError};
use crate::domain::{Cost, InvalidMessage, Registration, RouteName};

/// Where the routes file is, if there is one.
#[derive(Args, Clone, Debug, Default)]
#[command(next_help_heading = "Routes")]
pub struct RoutesArgs {
    /// A TOML file of routes (method, URL template, per-seller limit, default cost); a message's
    /// `route` picks one, and TURNSTILE_LIMIT stays the seller's budget over all of them.
    #[arg(long = "routes-file", env = "TURNSTILE_ROUTES_FILE")]
    pub file: Option<PathBuf>,
}

/// Most routes one file may name.
pub const MOST_ROUTES: usize = 64;

/// The HTTP methods a route may use.
const METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

/// One route: how its calls are made and what each seller may make of them.
#[derive(Clone, Debug)]
pub struct Route {
    pub name: RouteName,
    pub method: reqwest::Method,
    /// The URL template; `{seller_id}` is replaced as in `TURNSTILE_DOWNSTREAM_URL`.
    pub url: UrlTemplate,
    /// The route's per-seller stack (`limits set --seller S --route R` overrides it).
    pub limits: Limits,
    /// The cost of a call whose message gives none.
    pub cost: Option<Cost>,
    /// Whether one call carries several messages, and how.
    pub bulk: Option<Bulk>,
}

/// Most rows one bulk call may carry.
pub const MOST_BULK_ROWS: usize = 1_000;

/// Longest a bulk call may wait for more rows once its first row holds a permit: well within
/// the time a grant may wait for its call ([`crate::permit::CALL_ALLOWANCE`]).
pub const MOST_LINGER: Duration = Duration::from_millis(500);

/// How a bulk route's calls are counted by the provider, and so by its limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkCost {
    /// A call takes the route's cost once, however many rows it carries.
    Call,
    /// A call takes the sum of its rows' costs.
    Row,
}

/// A bulk route: one call carries up to `max_rows` messages of one seller and one route (see
/// the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bulk {
    /// Most rows one call carries (1 to [`MOST_BULK_ROWS`]).
    pub max_rows: usize,
    /// How long a call waits for more rows once its first row holds a permit (at most
    /// [`MOST_LINGER`]).
    pub linger: Duration,
    pub cost: BulkCost,
    /// The field of the request's (and the answer's) JSON object that holds the rows' array;
    /// without it, the body is the bare array.
    pub items: Option<String>,
    /// The field each product is given its `message_id` under, and by which the answer's
    /// entries are matched to rows (in order without it).
    pub id_field: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkEntry {
    max_rows: i64,
    #[serde(default)]
    linger: Option<String>,
    #[serde(default)]
    cost: Option<String>,
    #[serde(default)]
    items: Option<String>,
    #[serde(default)]
    id_field: Option<String>,
}

/// Longest field name a bulk route may name.
const MOST_FIELD: usize = 64;

impl Bulk {
    /// The bulk settings of a route's `bulk` table.
    fn parse(value: toml::Value) -> Result<Self, String> {
        let entry: BulkEntry = value
            .try_into()
            .map_err(|e: toml::de::Error| format!("field `bulk`: {}", one_line(e.message())))?;
        let max_rows = usize::try_from(entry.max_rows)
            .ok()
            .filter(|n| (1..=MOST_BULK_ROWS).contains(n))
            .ok_or_else(|| {
                format!(
                    "field `bulk.max_rows`: {} is not an integer from 1 to {MOST_BULK_ROWS}",
                    entry.max_rows
                )
            })?;
        let linger = match &entry.linger {
            None => Duration::from_millis(200).min(MOST_LINGER),
            Some(text) => humantime::parse_duration(text)
                .ok()
                .filter(|d| *d <= MOST_LINGER)
                .ok_or_else(|| {
                    format!(
                        "field `bulk.linger`: {text:?} is not a duration from 0ms to {}ms",
                        MOST_LINGER.as_millis()
                    )
                })?,
        };
        let cost = match entry.cost.as_deref() {
            None | Some("call") => BulkCost::Call,
            Some("row") => BulkCost::Row,
            Some(other) => {
                return Err(format!(
                    "field `bulk.cost`: {other:?} is neither \"call\" nor \"row\""
                ));
            }
        };
        let field = |name: &str, value: Option<String>| match value {
            Some(v)
                if v.is_empty()
                    || v.len() > MOST_FIELD
                    || !v
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                Err(format!(
                    "field `bulk.{name}`: {v:?} must be 1 to {MOST_FIELD} ASCII letters, digits, _ or -"
                ))
            }
            v => Ok(v),
        };
        Ok(Self {
            max_rows,
            linger,
            cost,
            items: field("items", entry.items)?,
            id_field: field("id_field", entry.id_field)?,
        })
    }
}

/// The routes of the routes file, by name (none without one).
#[derive(Clone, Debug, Default)]
pub struct Routes {
    routes: BTreeMap<RouteName, Arc<Route>>,
    /// The default endpoint's bulk calls (`[default] bulk = …`), for messages naming no route.
    default_bulk: Option<Bulk>,
}

/// Why a routes file was refused: one line naming the route and the field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct RoutesError(String);

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteEntry {
    method: String,
    url: String,
    limit: String,
    #[serde(default)]
    cost: Option<i64>,
    #[serde(default)]
    bulk: Option<toml::Value>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultEntry {
    #[serde(default)]
    bulk: Option<toml::Value>,
}

impl Routes {
    /// The routes of `args`' file, or none without one.
    pub fn load(args: &RoutesArgs) -> anyhow::Result<Self> {
        match &args.file {
            None => Ok(Self::default()),
            Some(path) => Self::read(path),
        }
    }

    /// The routes of the file at `path`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            anyhow::anyhow!(
                "TURNSTILE_ROUTES_FILE {}: cannot read it: {e}",
                path.display()
            )
        })?;
        Self::parse(&text)
            .map_err(|e| anyhow::anyhow!("TURNSTILE_ROUTES_FILE {}: {e}", path.display()))
    }

    /// The routes a file's text names (a `[routes.NAME]` table each).
    pub fn parse(text: &str) -> Result<Self, RoutesError> {
        let bad = |s: String| RoutesError(s);
        let table: toml::Table = toml::from_str(text)
            .map_err(|e| bad(format!("not valid TOML: {}", one_line(e.message()))))?;
        if let Some(other) = table.keys().find(|k| *k != "routes" && *k != "default") {
            return Err(bad(format!(
                "unknown table or key {other:?}: only [routes.NAME] tables and [default]"
            )));
        }
        let default_bulk = match table.get("default") {
            None => None,
            Some(value) => {
                let entry: DefaultEntry =
                    value.clone().try_into().map_err(|e: toml::de::Error| {
                        bad(format!("[default]: {}", one_line(e.message())))
                    })?;
                entry
                    .bulk
                    .map(Bulk::parse)
                    .transpose()
                    .map_err(|why| bad(format!("[default]: {why}")))?
            }
        };
        let empty = toml::Table::new();
        let routes = match table.get("routes") {
            Some(toml::Value::Table(routes)) => routes,
            None if default_bulk.is_some() => &empty,
            _ => return Err(bad("no [routes.NAME] table".into())),
        };
        if routes.is_empty() && default_bulk.is_none() {
            return Err(bad("no [routes.NAME] table".into()));
        }
        if routes.len() > MOST_ROUTES {
            return Err(bad(format!(
                "{} routes; at most {MOST_ROUTES}",
                routes.len()
            )));
        }
        let mut parsed = BTreeMap::new();
        for (name, value) in routes {
            let route = Self::route(name, value.clone())
                .map_err(|why| bad(format!("route {name:?}: {why}")))?;
            parsed.insert(route.name.clone(), Arc::new(route));
        }
        Ok(Self {
            routes: parsed,
            default_bulk,
        })
    }

    fn route(name: &str, value: toml::Value) -> Result<Route, String> {
        let name = RouteName::parse(name).map_err(|why| format!("its name {why}"))?;
        let entry: RouteEntry = value
            .try_into()
            .map_err(|e: toml::de::Error| one_line(e.message()))?;
        let method = entry.method.to_ascii_uppercase();
        if !METHODS.contains(&method.as_str()) {
            return Err(format!(
                "field `method`: {:?} is not one of {}",
                entry.method,
                METHODS.join(", ")
            ));
        }
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|_| format!("field `method`: {:?} is not a method", entry.method))?;
        let url = UrlTemplate::parse(&entry.url).map_err(|e| match e {
            UrlTemplateError::Invalid(why) => format!("field `url`: not a valid URL ({why})"),
            UrlTemplateError::Scheme
            | UrlTemplateError::UnknownPlaceholder(_)
            | UrlTemplateError::Unclosed => format!("field `url`: {e}"),
        })?;
        let limits: Limits = entry
            .limit
            .parse()
            .map_err(|e| format!("field `limit`: {e}"))?;
        let cost = match entry.cost {
            None => None,
            Some(units) => Some(u32::try_from(units).ok().and_then(Cost::new).ok_or_else(
                || {
                    format!(
                        "field `cost`: {units} is not an integer from 1 to {}",
                        Cost::MAX
                    )
                },
            )?),
        };
        if let Some(cost) = cost
            && cost.units() > limits.min_count()
        {
            return Err(format!(
                "field `cost`: {cost} is more than the route's limit {limits} ever grants at once"
            ));
        }
        let bulk = entry.bulk.map(Bulk::parse).transpose()?;
        Ok(Route {
            name,
            method,
            url,
            limits,
            cost,
            bulk,
        })
    }

    /// Whether there are no routes (no routes file).
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// How the calls of messages on `route` (none: the default endpoint) are made in bulk, if
    /// they are.
    pub fn bulk(&self, route: Option<&RouteName>) -> Option<&Bulk> {
        match route {
            None => self.default_bulk.as_ref(),
            Some(name) => self.get(name)?.bulk.as_ref(),
        }
    }

    /// The most rows any bulk call carries (0 without bulk calls).
    pub fn most_bulk_rows(&self) -> usize {
        self.routes
            .values()
            .filter_map(|r| r.bulk.as_ref())
            .chain(self.default_bulk.as_ref())
            .map(|b| b.max_rows)
            .max()
            .unwrap_or(0)
    }

    /// The route named `name`.
    pub fn get(&self, name: &RouteName) -> Option<&Arc<Route>> {
        self.routes.get(name)
    }

    /// Every route, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Route>> + '_ {
        self.routes.values()
    }

    /// The route `registration` takes, checked against the file: a route the file does not
    /// name (or any route, without a file) makes the message invalid. A message without a
    /// `cost` takes its route's default cost; on a bulk route whose calls count once
    /// ([`BulkCost::Call`]) every message takes the route's cost (one call's), whatever it
    /// gives.
    pub fn resolve(&self, registration: &mut Registration) -> Result<(), InvalidMessage> {
        let Some(name) = &registration.route else {
            if self
                .default_bulk
                .as_ref()
                .is_some_and(|b| b.cost == BulkCost::Call)
            {
                registration.cost = Cost::ONE;
            }
            return Ok(());
        };
        let route = self.get(name).ok_or(InvalidMessage::Field {
            field: "route",
            why: "names no route of the routes file",
        })?;
        if !registration.cost_given
            && let Some(cost) = route.cost
        {
            registration.cost = cost;
        }
        // On a bulk route whose calls count once, a row's call is its call's: the route's cost.
        if route
            .bulk
            .as_ref()
            .is_some_and(|b| b.cost == BulkCost::Call)
        {
            registration.cost = route.cost.unwrap_or(Cost::ONE);
        }
        Ok(())
    }
}

/// An error message on one line (TOML's may span several).
fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[routes.register]
method = "POST"
url = "https://api.example.com/sellers/{seller_id}/products"
limit = "100/1m"
cost = 1

[routes.price]
method = "put"
url = "https://api.example.com/price?seller={seller_id}"
limit = "600/1m,10000/1d"
"#;

    #[test]
    fn a_routes_file_names_each_route_with_its_method_url_limit_and_cost() {
        let routes = Routes::parse(FILE).unwrap();
        let register = routes.get(&RouteName::parse("register").unwrap()).unwrap();
        assert_eq!(register.method, reqwest::Method::POST);
        assert!(register.url.seller_in_path());
        assert_eq!(register.limits.to_string(), "100/1m");
        assert_eq!(register.cost, Cost::new(1));
        let price = routes.get(&RouteName::parse("price").unwrap()).unwrap();
        assert_eq!(price.method, reqwest::Method::PUT);
        assert!(!price.url.seller_in_path());
        assert_eq!(price.cost, None);
        assert_eq!(routes.iter().count(), 2);
    }

    #[test]
    fn the_contracts_example_is_a_routes_file() {
        let example = r#"
[routes.register]
method = "POST"
url = "https://api.example.com/sellers/{seller_id}/products"
limit = "100/1m"        # this route's per-seller stack; TURNSTILE_LIMIT is the budget over all
cost = 1                # default cost of a call on this route (a message's `cost` overrides)

[routes.price]
method = "PUT"
url = "https://api.example.com/sellers/{seller_id}/price"
limit = "600/1m,10000/1d@00:00+09:00"
"#;
        let routes = Routes::parse(example).unwrap();
        let price = routes.get(&RouteName::parse("price").unwrap()).unwrap();
        assert!(price.limits.has_calendar());
        assert_eq!(price.limits.to_string(), "600/1m,10000/1d@00:00+09:00");
    }

    #[test]
    fn a_bad_file_is_refused_in_one_line_naming_the_route_and_the_field() {
        let cases = [
            (
                FILE.replace("100/1m", "100 per minute"),
                "route \"register\": field `limit`",
            ),
            (
                FILE.replace("\"put\"", "\"TRACE\""),
                "route \"price\": field `method`",
            ),
            (
                FILE.replace("https://api.example.com/price", "ftp://x"),
                "route \"price\": field `url`",
            ),
            (
                FILE.replace("seller={seller_id}", "seller={seller}"),
                "route \"price\": field `url`: unknown placeholder {seller}: the only placeholder is {seller_id}",
            ),
            (
                FILE.replace("cost = 1", "cost = 0"),
                "route \"register\": field `cost`",
            ),
            (
                FILE.replace("cost = 1", "cost = 101"),
                "route \"register\": field `cost`",
            ),
            (
                FILE.replace("cost = 1", "coast = 1"),
                "route \"register\": unknown field `coast`",
            ),
            (
                FILE.replace("[routes.price]", "[routes.\"pri ce\"]"),
                "route \"pri ce\": its name",
            ),
            (
                FILE.replace("[routes.price]", "[rotes.price]"),
                "unknown table or key \"rotes\"",
            ),
            ("".to_owned(), "no [routes.NAME] table"),
            ("[routes".to_owned(), "not valid TOML"),
        ];
        for (text, expected) in cases {
            let error = Routes::parse(&text).unwrap_err().to_string();
            assert!(
                error.contains(expected),
                "{error:?} should say {expected:?}"
            );
            assert!(!error.contains('\n'), "{error:?} is one line");
        }
    }

    #[test]
    fn a_route_or_the_default_endpoint_may_be_bulk_with_its_rows_linger_and_count() {
        let text = format!(
            "{FILE}\n[routes.listings]\nmethod = \"POST\"\nurl = \"https://api.example.com/{{seller_id}}/batch\"\nlimit = \"100/1m\"\nbulk = {{ max_rows = 50, linger = \"200ms\", cost = \"call\", items = \"items\", id_field = \"message_id\" }}\n\n[default]\nbulk = {{ max_rows = 25, cost = \"row\" }}\n"
        );
        let routes = Routes::parse(&text).unwrap();
        let listings = RouteName::parse("listings").unwrap();
        let bulk = routes.bulk(Some(&listings)).unwrap();
        assert_eq!(
            *bulk,
            Bulk {
                max_rows: 50,
                linger: Duration::from_millis(200),
                cost: BulkCost::Call,
                items: Some("items".into()),
                id_field: Some("message_id".into()),
            }
        );
        let default = routes.bulk(None).unwrap();
        assert_eq!((default.max_rows, default.cost), (25, BulkCost::Row));
        assert_eq!(
            (default.items.as_deref(), default.id_field.as_deref()),
            (None, None)
        );
        assert_eq!(
            routes.bulk(Some(&RouteName::parse("register").unwrap())),
            None
        );
        assert_eq!(routes.most_bulk_rows(), 50);
        // A file of the default endpoint's bulk calls alone names no route.
        let alone = Routes::parse("[default]\nbulk = { max_rows = 10 }\n").unwrap();
        assert!(alone.is_empty());
        assert_eq!(alone.bulk(None).unwrap().linger, Duration::from_millis(200));
        assert_eq!(Routes::parse(FILE).unwrap().bulk(None), None);
    }

    #[test]
    fn a_bad_bulk_table_is_refused_naming_its_field() {
        let cases = [
            ("max_rows = 0", "field `bulk.max_rows`"),
            ("max_rows = 1001", "field `bulk.max_rows`"),
            ("max_rows = 5, linger = \"2s\"", "field `bulk.linger`"),
            ("max_rows = 5, linger = \"soon\"", "field `bulk.linger`"),
            ("max_rows = 5, cost = \"rows\"", "field `bulk.cost`"),
            ("max_rows = 5, items = \"a b\"", "field `bulk.items`"),
            ("max_rows = 5, id_field = \"\"", "field `bulk.id_field`"),
            ("max_rows = 5, rows = 3", "unknown field `rows`"),
            ("linger = \"1ms\"", "missing field `max_rows`"),
        ];
        for (table, expected) in cases {
            let text = format!("[default]\nbulk = {{ {table} }}\n");
            let error = Routes::parse(&text).unwrap_err().to_string();
            assert!(
                error.contains(expected),
                "{table}: {error:?} should say {expected:?}"
            );
            let text = FILE.replace("cost = 1", &format!("cost = 1\nbulk = {{ {table} }}"));
            let error = Routes::parse(&text).unwrap_err().to_string();
            assert!(
                error.contains("route \"register\"") && error.contains(expected),
                "{error}"
            );
        }
        let error = Routes::parse("[default]\nlimit = \"1/1s\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("[default]") && error.contains("unknown field"),
            "{error}"
        );
    }

    #[test]
    fn a_message_takes_its_routes_default_cost_unless_it_gives_one() {
        let routes = Routes::parse(&FILE.replace("cost = 1", "cost = 3")).unwrap();
        let body = br#"{"seller_id":"S","route":"register","product":{}}"#;
        let mut r = Registration::parse(body, None).unwrap();
        routes.resolve(&mut r).unwrap();
        assert_eq!(r.cost.units(), 3);
        let body = br#"{"seller_id":"S","route":"register","cost":2,"product":{}}"#;
        let mut r = Registration::parse(body, None).unwrap();
        routes.resolve(&mut r).unwrap();
        assert_eq!(r.cost.units(), 2);
    }

    #[test]
    fn a_route_the_file_does_not_name_makes_the_message_invalid() {
        let body = br#"{"seller_id":"S","route":"stock","product":{}}"#;
        let mut r = Registration::parse(body, None).unwrap();
        let error = Routes::parse(FILE).unwrap().resolve(&mut r).unwrap_err();
        assert!(error.to_string().contains("route"));
        let mut r = Registration::parse(body, None).unwrap();
        assert!(Routes::default().resolve(&mut r).is_err());
        let body = br#"{"seller_id":"S","route":"a b","product":{}}"#;
        assert!(Registration::parse(body, None).is_err());
        let body = br#"{"seller_id":"S","route":7,"product":{}}"#;
        assert!(Registration::parse(body, None).is_err());
    }
}
