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

/// A copy of the manifests in a directory of its own, altered by `replace` and `remove`.
struct Altered(PathBuf);

impl Altered {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("turnstile-deploy-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(manifests()).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
        Altered(dir)
    }

    /// Replaces `from`, which `file` must hold exactly once, by `to`.
    fn replace(self, file: &str, from: &str, to: &str) -> Self {
        let target = self.0.join(file);
        let text = std::fs::read_to_string(&target).unwrap();
        assert_eq!(
            text.matches(from).count(),
            1,
            "{file} should hold {from:?} exactly once"
        );
        std::fs::write(&target, text.replacen(from, to, 1)).unwrap();
        self
    }

    /// Deletes `file` from the copy.
    fn remove(self, file: &str) -> Self {
        std::fs::remove_file(self.0.join(file)).unwrap();
        self
    }

    /// Without servicemonitor.yaml, deleted and taken out of the kustomization as deployment.yaml
    /// says to do without the Prometheus Operator.
    fn without_service_monitor(self) -> Self {
        self.remove("servicemonitor.yaml").replace(
            "kustomization.yaml",
            "  - servicemonitor.yaml\n",
            "",
        )
    }

    /// Validates the copy; it must fail, and what it printed is returned.
    fn rejected(&self) -> String {
        let (ok, out) = validate(&self.0);
        assert!(!ok, "the validator accepted a broken manifest:\n{out}");
        out
    }

    /// Validates the copy; it must fail with `problem` among what it printed, which is
    /// returned.
    fn rejected_saying(&self, problem: &str) -> String {
        let out = self.rejected();
        assert!(out.contains(problem), "expected {problem:?} in:\n{out}");
        out
    }

    /// Validates the copy; it must pass, and what it printed is returned.
    fn accepted(&self) -> String {
        let (ok, out) = validate(&self.0);
        assert!(ok, "the validator refused a valid variant:\n{out}");
        out
    }
}

impl Drop for Altered {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The pod annotations that deployment.yaml's comment says to add without the Prometheus
/// Operator, commented out as they are there...
const ANNOTATIONS_COMMENTED: &str = "      #   annotations:
      #     prometheus.io/scrape: \"true\"
      #     prometheus.io/port: \"9464\"
      #     prometheus.io/path: /metrics
";
/// ...and in effect.
const ANNOTATIONS: &str = "      annotations:
        prometheus.io/scrape: \"true\"
        prometheus.io/port: \"9464\"
        prometheus.io/path: /metrics
";

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
    let broken = Altered::new("grace").replace(
        "deployment.yaml",
        "terminationGracePeriodSeconds: 15",
        "terminationGracePeriodSeconds: 8",
    );
    broken.rejected_saying("deployment.yaml: Deployment turnstile: spec.template.spec.terminationGracePeriodSeconds 8 must exceed TURNSTILE_SHUTDOWN_GRACE (8s");
}

#[test]
fn a_misspelled_scaled_object_field_is_rejected() {
    let broken = Altered::new("misspelled").replace(
        "scaledobject.yaml",
        "      authenticationRef:",
        "      authRef:",
    );
    broken.rejected_saying(
        "scaledobject.yaml: ScaledObject turnstile: spec.triggers[0].authRef: unknown field",
    );
}

#[test]
fn a_value_of_the_wrong_type_is_rejected_by_the_schema() {
    let broken = Altered::new("type").replace(
        "scaledobject.yaml",
        "maxReplicaCount: 16",
        "maxReplicaCount: sixteen",
    );
    broken.rejected_saying(
        "scaledobject.yaml: ScaledObject turnstile: schema: spec/maxReplicaCount must be integer",
    );
}

#[test]
fn a_setting_the_binary_does_not_read_is_rejected() {
    let broken = Altered::new("setting").replace(
        "configmap.yaml",
        "TURNSTILE_WORKERS: \"16\"",
        "TURNSTILE_WORKER: \"16\"",
    );
    broken.rejected_saying("configmap.yaml: ConfigMap turnstile-config: TURNSTILE_WORKER: not a variable turnstile consume reads");
}

#[test]
fn a_scaled_object_watching_another_queue_than_the_consumers_is_rejected() {
    let broken = Altered::new("queue").replace(
        "configmap.yaml",
        "TURNSTILE_QUEUE: registrations",
        "TURNSTILE_QUEUE: uploads",
    );
    broken.rejected_saying("scaledobject.yaml: ScaledObject turnstile: spec.triggers: no rabbitmq trigger on the work queue \"uploads\"");
}

#[test]
fn the_shipped_pods_carry_no_scrape_annotations() {
    let deployment = std::fs::read_to_string(manifests().join("deployment.yaml")).unwrap();
    assert!(
        deployment.contains(ANNOTATIONS_COMMENTED),
        "deployment.yaml's comment should show the annotations to add without the operator"
    );
    assert!(
        !deployment.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with("prometheus.io/") || l.starts_with("annotations:")
        }),
        "deployment.yaml's pods must not carry scrape annotations beside the ServiceMonitor"
    );
}

#[test]
fn pod_annotations_beside_a_service_monitor_are_rejected() {
    let broken =
        Altered::new("both").replace("deployment.yaml", ANNOTATIONS_COMMENTED, ANNOTATIONS);
    let out = broken.rejected_saying("deployment.yaml: Deployment turnstile: spec.template.metadata.annotations: prometheus.io/scrape \"true\" on pods that the ServiceMonitor turnstile (servicemonitor.yaml, through the Service turnstile-metrics) also scrapes");
    assert_eq!(out.matches("FAIL").count(), 1, "{out}");
}

#[test]
fn pod_annotations_instead_of_the_service_monitor_are_accepted() {
    let variant = Altered::new("annotations")
        .replace("deployment.yaml", ANNOTATIONS_COMMENTED, ANNOTATIONS)
        .without_service_monitor();
    let out = variant.accepted();
    assert!(!out.contains("ServiceMonitor"), "{out}");
}

#[test]
fn pod_annotations_on_another_port_are_rejected() {
    let broken = Altered::new("annotation-port")
        .replace(
            "deployment.yaml",
            ANNOTATIONS_COMMENTED,
            &ANNOTATIONS.replace("\"9464\"", "\"9090\""),
        )
        .without_service_monitor();
    broken.rejected_saying("deployment.yaml: Deployment turnstile: spec.template.metadata.annotations: with prometheus.io/scrape \"true\", prometheus.io/port must be \"9464\"");
}

#[test]
fn neither_a_service_monitor_nor_pod_annotations_is_rejected() {
    let broken = Altered::new("unscraped").without_service_monitor();
    broken.rejected_saying(
        "deployment.yaml: Deployment turnstile: nothing scrapes the replicas' /metrics",
    );
}

#[test]
fn the_kustomization_leaves_the_placeholder_secret_out() {
    let kustomization = std::fs::read_to_string(manifests().join("kustomization.yaml")).unwrap();
    assert!(
        !kustomization.lines().any(|l| l.trim() == "- secret.yaml"),
        "kustomization.yaml must not apply secret.yaml's placeholders:\n{kustomization}"
    );
    assert!(manifests().join("secret.yaml").is_file());
}

#[test]
fn a_kustomization_listing_the_placeholder_secret_is_rejected() {
    let broken = Altered::new("secret-listed").replace(
        "kustomization.yaml",
        "  - configmap.yaml\n",
        "  - configmap.yaml\n  - secret.yaml\n",
    );
    let out = broken.rejected_saying("kustomization.yaml: Kustomization: resources lists secret.yaml, the Secret's template: `kubectl apply -k` would overwrite the real credentials");
    assert_eq!(out.matches("FAIL").count(), 1, "{out}");
}

#[test]
fn a_kustomization_missing_a_manifest_is_rejected() {
    let broken =
        Altered::new("unlisted").replace("kustomization.yaml", "  - scaledobject.yaml\n", "");
    broken.rejected_saying(
        "kustomization.yaml: Kustomization: resources does not list scaledobject.yaml",
    );
}

#[test]
fn the_unlisted_secret_is_still_validated() {
    let broken = Altered::new("secret-url").replace(
        "secret.yaml",
        "TURNSTILE_AMQP_URL: amqp://",
        "TURNSTILE_AMQP_URL: http://",
    );
    broken
        .rejected_saying("secret.yaml: Secret turnstile-credentials: TURNSTILE_AMQP_URL \"http://");

    let broken = Altered::new("secret-field").replace("secret.yaml", "stringData:", "stringdata:");
    let out = broken
        .rejected_saying("secret.yaml: Secret turnstile-credentials: stringdata: unknown field");
    assert!(
        out.contains("secret.yaml: Secret turnstile-credentials: TURNSTILE_AMQP_URL is missing"),
        "{out}"
    );
}
