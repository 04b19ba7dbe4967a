//! deploy/kubernetes against the schemas of Kubernetes, KEDA and the Prometheus Operator and
//! against what turnstile needs of it, through `deploy/validate/validate.mjs` (Node; its npm
//! packages are installed by scripts/test.sh). The validator is given this build's
//! `turnstile consume --help`, so every ConfigMap and Secret key must be a variable this binary
//! reads, and the binary itself for the variables read beside the flags.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn manifests() -> PathBuf {
    root().join("deploy/kubernetes")
}

/// This build's `turnstile consume --help`.
fn consume_help() -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["consume", "--help"])
        .output()
        .expect("running turnstile consume --help");
    assert!(out.status.success(), "turnstile consume --help failed");
    out.stdout
}

/// Runs the validator on `dir`: whether it passed, and what it printed.
fn validate(dir: &Path) -> (bool, String) {
    let validator = root().join("deploy/validate");
    assert!(
        validator.join("node_modules/kubernetes-models").is_dir()
            && validator.join("node_modules/typescript").is_dir(),
        "{} is missing or incomplete: run scripts/test.sh, which installs the validator's npm \
         packages (npm ci --prefix deploy/validate)",
        validator.join("node_modules").display()
    );
    let mut child = Command::new("node")
        .arg(validator.join("validate.mjs"))
        .args([
            "--consume-help",
            "-",
            "--binary",
            env!("CARGO_BIN_EXE_turnstile"),
        ])
        .arg(dir)
        .current_dir(root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running node (v18 or later is needed): {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&consume_help())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "the validator could not run (exit {:?}):\n{text}",
        out.status.code()
    );
    (out.status.success(), text)
}

/// A copy of the manifests in a directory of its own, with `from` replaced by `to` in `file`.
struct Broken(PathBuf);

impl Broken {
    fn new(name: &str, file: &str, from: &str, to: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("turnstile-deploy-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(manifests()).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
        let target = dir.join(file);
        let text = std::fs::read_to_string(&target).unwrap();
        assert_eq!(
            text.matches(from).count(),
            1,
            "{file} should hold {from:?} exactly once"
        );
        std::fs::write(&target, text.replacen(from, to, 1)).unwrap();
        Broken(dir)
    }

    /// Validates the copy; it must fail, and what it printed is returned.
    fn rejected(&self) -> String {
        let (ok, out) = validate(&self.0);
        assert!(!ok, "the validator accepted a broken manifest:\n{out}");
        out
    }
}

impl Drop for Broken {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_kubernetes_manifests_pass_the_schemas_and_the_checks() {
    let (ok, out) = validate(&manifests());
    assert!(ok, "deploy/kubernetes does not validate:\n{out}");
    for object in [
        "ConfigMap turnstile-config",
        "Secret turnstile-credentials",
        "Deployment turnstile",
        "Service turnstile-metrics",
        "ServiceMonitor turnstile",
        "PodDisruptionBudget turnstile",
        "TriggerAuthentication turnstile-rabbitmq",
        "ScaledObject turnstile",
    ] {
        assert!(
            out.contains(&format!(": {object}")),
            "{object} not validated:\n{out}"
        );
    }
    assert!(out.contains("turnstile's checks across the"), "{out}");
    assert!(out.contains("all valid"), "{out}");
}

#[test]
fn a_termination_grace_not_above_the_shutdown_grace_is_rejected() {
    let broken = Broken::new(
        "grace",
        "deployment.yaml",
        "terminationGracePeriodSeconds: 15",
        "terminationGracePeriodSeconds: 8",
    );
    let out = broken.rejected();
    assert!(
        out.contains("deployment.yaml: Deployment turnstile: spec.template.spec.terminationGracePeriodSeconds 8 must exceed TURNSTILE_SHUTDOWN_GRACE (8s"),
        "{out}"
    );
}

#[test]
fn a_misspelled_scaled_object_field_is_rejected() {
    let broken = Broken::new(
        "misspelled",
        "scaledobject.yaml",
        "      authenticationRef:",
        "      authRef:",
    );
    let out = broken.rejected();
    assert!(
        out.contains(
            "scaledobject.yaml: ScaledObject turnstile: spec.triggers[0].authRef: unknown field"
        ),
        "{out}"
    );
}

#[test]
fn a_value_of_the_wrong_type_is_rejected_by_the_schema() {
    let broken = Broken::new(
        "type",
        "scaledobject.yaml",
        "maxReplicaCount: 16",
        "maxReplicaCount: sixteen",
    );
    let out = broken.rejected();
    assert!(
        out.contains("scaledobject.yaml: ScaledObject turnstile: schema: spec/maxReplicaCount must be integer"),
        "{out}"
    );
}

#[test]
fn a_setting_the_binary_does_not_read_is_rejected() {
    let broken = Broken::new(
        "setting",
        "configmap.yaml",
        "TURNSTILE_WORKERS: \"16\"",
        "TURNSTILE_WORKER: \"16\"",
    );
    let out = broken.rejected();
    assert!(
        out.contains("configmap.yaml: ConfigMap turnstile-config: TURNSTILE_WORKER: not a variable turnstile consume reads"),
        "{out}"
    );
}

#[test]
fn a_scaled_object_watching_another_queue_than_the_consumers_is_rejected() {
    let broken = Broken::new(
        "queue",
        "configmap.yaml",
        "TURNSTILE_QUEUE: registrations",
        "TURNSTILE_QUEUE: uploads",
    );
    let out = broken.rejected();
    assert!(
        out.contains("scaledobject.yaml: ScaledObject turnstile: spec.triggers: no rabbitmq trigger on the work queue \"uploads\""),
        "{out}"
    );
}
