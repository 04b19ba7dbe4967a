//! The monitoring stack as users run it, checked by the tools that run it: `docker compose
//! config` accepts docker-compose.yml with Prometheus and Grafana, and `promtool` accepts the
//! Prometheus config and the alert rules and runs the rules' unit tests. scripts/test.sh
//! installs both tools (Debian's docker-compose; promtool from Debian's prometheus package,
//! unpacked into target/tools).

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `docker compose` (v2) where it works, else `docker-compose` (v1).
fn compose() -> Command {
    let v2 = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if v2 {
        let mut command = Command::new("docker");
        command.arg("compose");
        command
    } else {
        assert!(
            Command::new("docker-compose")
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success()),
            "neither `docker compose` nor `docker-compose` runs: run scripts/test.sh (README's \
             test command), which installs Debian's docker-compose"
        );
        Command::new("docker-compose")
    }
}

/// `PROMTOOL`, or promtool on the PATH, or the one scripts/test.sh unpacks into target/tools.
fn promtool() -> Command {
    let path = std::env::var_os("PROMTOOL")
        .map(PathBuf::from)
        .or_else(|| {
            Command::new("promtool")
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
                .then(|| PathBuf::from("promtool"))
        })
        .unwrap_or_else(|| Path::new(ROOT).join("target/tools/promtool"));
    assert!(
        path == Path::new("promtool") || path.exists(),
        "no promtool at {}: run scripts/test.sh (README's test command), which unpacks it from \
         Debian's prometheus package, or set PROMTOOL",
        path.display()
    );
    Command::new(path)
}

/// Runs `command` in `dir`; its exit status and what it printed.
fn run(mut command: Command, dir: &Path) -> (bool, String) {
    let output = command.current_dir(dir).output().expect("the tool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn docker_compose_accepts_the_stack_with_prometheus_and_grafana() {
    let mut config = compose();
    config.args(["-f", "docker-compose.yml", "config", "--services"]);
    let (ok, services) = run(config, Path::new(ROOT));
    assert!(
        ok,
        "docker compose config refused docker-compose.yml:\n{services}"
    );
    for service in [
        "rabbitmq",
        "redis",
        "mock-api",
        "consumer",
        "producer",
        "prometheus",
        "grafana",
    ] {
        assert!(
            services.lines().any(|l| l.trim() == service),
            "no service {service}:\n{services}"
        );
    }
    // What the compose file mounts is in the repository.
    let file = std::fs::read_to_string(Path::new(ROOT).join("docker-compose.yml")).unwrap();
    let mounts: Vec<&str> = file
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- ./"))
        .map(|l| l.split(':').next().unwrap())
        .collect();
    assert!(mounts.len() >= 3, "{mounts:?}");
    for mount in mounts {
        assert!(
            Path::new(ROOT).join(mount).exists(),
            "{mount} is mounted but missing"
        );
    }
}

#[test]
fn docker_compose_refuses_a_broken_stack() {
    let dir = std::env::temp_dir().join(format!("turnstile-compose-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = std::fs::read_to_string(Path::new(ROOT).join("docker-compose.yml")).unwrap();
    let broken = file.replacen(
        "    restart: unless-stopped",
        "    restart_policy: sometimes",
        1,
    );
    assert_ne!(broken, file);
    std::fs::write(dir.join("docker-compose.yml"), broken).unwrap();
    let mut config = compose();
    config.args(["-f", "docker-compose.yml", "config", "-q"]);
    let (ok, said) = run(config, &dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!ok, "a misspelled key passed:\n{said}");
    assert!(said.contains("restart_policy"), "{said}");
}

#[test]
fn promtool_accepts_the_prometheus_config_and_the_alert_rules() {
    let dir = Path::new(ROOT).join("deploy/prometheus");
    let mut check = promtool();
    check.args(["check", "config", "prometheus.yml"]);
    let (ok, said) = run(check, &dir);
    assert!(ok, "{said}");
    assert!(said.contains("SUCCESS"), "{said}");
    let mut check = promtool();
    check.args(["check", "rules", "alerts.yml"]);
    let (ok, said) = run(check, &dir);
    assert!(ok, "{said}");
}

#[test]
fn the_alert_rules_fire_when_their_unit_tests_say() {
    let mut test = promtool();
    test.args(["test", "rules", "alerts.test.yml"]);
    let (ok, said) = run(test, &Path::new(ROOT).join("deploy/prometheus"));
    assert!(ok, "{said}");
}

#[test]
fn promtool_refuses_a_broken_rule() {
    let dir = std::env::temp_dir().join(format!("turnstile-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = std::fs::read_to_string(Path::new(ROOT).join("deploy/prometheus/alerts.yml"))
        .unwrap()
        .replacen(
            "expr: turnstile_ready == 0",
            "expr: turnstile_ready == = 0",
            1,
        );
    std::fs::write(dir.join("alerts.yml"), rules).unwrap();
    let mut check = promtool();
    check.args(["check", "rules", "alerts.yml"]);
    let (ok, said) = run(check, &dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!ok, "a broken expression passed:\n{said}");
}

#[test]
fn every_query_of_the_grafana_dashboard_is_promql_promtool_accepts() {
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../deploy/grafana/turnstile.json")).unwrap();
    let mut queries = Vec::new();
    let mut stack = vec![&dashboard["panels"]];
    while let Some(panels) = stack.pop() {
        for panel in panels.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                queries.push(target["expr"].as_str().unwrap().to_owned());
            }
            stack.push(&panel["panels"]);
        }
    }
    assert!(queries.len() >= 20);
    // Each query as a recording rule, with Grafana's variables as Grafana would set them.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (n, query) in queries.iter().enumerate() {
        let query = query
            .replace("$__rate_interval", "1m")
            .replace("$instance", ".*");
        assert!(
            !query.contains('$'),
            "a variable promtool cannot see: {query}"
        );
        let quoted = serde_json::to_string(&query).unwrap(); // a JSON string is a YAML string
        rules.push_str(&format!(
            "      - record: dashboard:query_{n}\n        expr: {quoted}\n"
        ));
    }
    let dir = std::env::temp_dir().join(format!("turnstile-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("queries.yml"), &rules).unwrap();
    let mut check = promtool();
    check.args(["check", "rules", "queries.yml"]);
    let (ok, said) = run(check, &dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(ok, "{said}\n{rules}");
    assert!(
        said.contains(&format!("{} rules found", queries.len())),
        "{said}"
    );
}

/// Each alert of alerts.yml with its rule's text.
fn alert_rules() -> Vec<(String, String)> {
    let rules = include_str!("../deploy/prometheus/alerts.yml");
    rules
        .split("- alert: ")
        .skip(1)
        .map(|rule| {
            let (name, body) = rule.split_once('\n').expect("a rule after its name");
            (name.trim().to_owned(), body.to_owned())
        })
        .collect()
}

/// The value of `key: value` in a rule's text, if the rule has it.
fn rule_value<'a>(rule: &'a str, key: &str) -> Option<&'a str> {
    rule.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}: ")))
        .map(|v| v.trim().trim_matches('"'))
}

#[test]
fn every_alert_waits_has_a_severity_and_a_runbook_section_of_its_own() {
    let alerts = alert_rules();
    assert!(alerts.len() >= 12, "{} alerts", alerts.len());
    let runbooks = include_str!("../docs/runbooks.md");
    let sections: Vec<&str> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .collect();
    for (name, rule) in &alerts {
        let wait = rule_value(rule, "for").unwrap_or_else(|| panic!("{name} has no for:"));
        assert!(
            wait.ends_with('m') && wait != "0m",
            "{name} fires at once (for: {wait})"
        );
        let severity = rule_value(rule, "severity");
        assert!(
            matches!(severity, Some("critical" | "warning" | "info")),
            "{name}: severity {severity:?}"
        );
        let url = rule_value(rule, "runbook_url");
        assert_eq!(
            url,
            Some(format!("docs/runbooks.md#{}", name.to_lowercase()).as_str()),
            "{name}'s runbook_url"
        );
        assert!(
            sections.contains(&name.as_str()),
            "docs/runbooks.md has no section `## {name}`"
        );
        let section = runbooks
            .split(&format!("## {name}\n"))
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .unwrap();
        for part in ["**What it means.**", "**Confirm.**", "**Fix.**"] {
            assert!(section.contains(part), "{name}'s runbook has no {part}");
        }
    }
    for section in sections.iter().filter(|s| s.starts_with("Turnstile")) {
        assert!(
            alerts.iter().any(|(name, _)| name == section),
            "docs/runbooks.md's `## {section}` is no alert of alerts.yml"
        );
    }
}

#[test]
fn every_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_quiet() {
    let tests = include_str!("../deploy/prometheus/alerts.test.yml");
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let mut fires = std::collections::BTreeSet::new();
    let mut quiet = std::collections::BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.strip_prefix("alertname: ") else {
            continue;
        };
        let expected = lines[i + 1..].iter().find(|l| !l.is_empty()).unwrap();
        match *expected {
            "exp_alerts: []" => quiet.insert(name),
            "exp_alerts:" => fires.insert(name),
            other => panic!("{name}: {other}"),
        };
    }
    for (name, _) in alert_rules() {
        assert!(
            fires.contains(name.as_str()),
            "alerts.test.yml never sees {name} fire"
        );
        assert!(
            quiet.contains(name.as_str()),
            "alerts.test.yml never sees {name} stay quiet"
        );
    }
}
