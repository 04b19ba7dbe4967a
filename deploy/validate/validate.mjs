#!/usr/bin/env node
// Validates every document of every YAML file under deploy/kubernetes (or the directories
// given), then checks what turnstile itself needs of them. Run by tests/deploy.rs; installed
// by scripts/test.sh (`npm ci --prefix deploy/validate`).
//
//   node deploy/validate/validate.mjs --consume-help FILE|- [--binary PATH] [DIR...]
//
// --consume-help: the text of `turnstile consume --help` (`-` reads it from stdin). Every
//   ConfigMap and Secret key must be a variable it lists (`[env: NAME]`), and the defaults it
//   prints stand in for unset keys (e.g. TURNSTILE_SHUTDOWN_GRACE's 8s).
// --binary: the turnstile binary; a key the help does not list is accepted only if it is one
//   of the variables read beside the flags (READ_BESIDE_FLAGS) and the binary contains its name.
//
// Three layers, each reported with file, kind, name and path:
// 1. Schema: each document is validated by the JSON Schema of its kind, as bundled by the npm
//    packages kubernetes-models (the Kubernetes OpenAPI), @kubernetes-models/keda (KEDA's CRDs)
//    and @kubernetes-models/prometheus-operator (its CRDs): types, required fields, enums,
//    formats. A kind none of them has is an error.
// 2. Unknown fields: those JSON schemas accept fields they do not define, as the API server
//    does without strict field validation, and a CRD's structural schema prunes them without a
//    word: a misspelled `minReplicaCount` in a ScaledObject would be dropped silently. So every
//    field must also be one that the same packages' type declarations (generated from the
//    same schemas) define, walked with the TypeScript compiler's type checker.
// 3. turnstile's own invariants across documents (see checkInvariants).
//
// Exit status: 0 all valid, 1 a document failed, 2 a usage or installation error.

import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));

// --- the packages (a clear message when they are not installed) ------------------------------

async function load(specifier) {
  try {
    return await import(specifier);
  } catch (error) {
    if (error && (error.code === "ERR_MODULE_NOT_FOUND" || error.code === "MODULE_NOT_FOUND")) {
      usageError(
        `cannot load ${specifier}: ${path.join(here, "node_modules")} is missing or incomplete; ` +
          "run scripts/test.sh (or `npm ci --prefix deploy/validate`) first",
      );
    }
    throw error;
  }
}

function usageError(message) {
  console.error(`validate.mjs: ${message}`);
  process.exit(2);
}

// apiVersion/kind -> [module, model class, type declaration]. The module of the model class
// also declares its interface `I<Kind>`.
const KINDS = {
  "v1/ConfigMap": ["kubernetes-models/v1/ConfigMap", "ConfigMap"],
  "v1/Secret": ["kubernetes-models/v1/Secret", "Secret"],
  "v1/Service": ["kubernetes-models/v1/Service", "Service"],
  "apps/v1/Deployment": ["kubernetes-models/apps/v1/Deployment", "Deployment"],
  "policy/v1/PodDisruptionBudget": ["kubernetes-models/policy/v1/PodDisruptionBudget", "PodDisruptionBudget"],
  "keda.sh/v1alpha1/ScaledObject": ["@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject", "ScaledObject"],
  "keda.sh/v1alpha1/TriggerAuthentication": [
    "@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication",
    "TriggerAuthentication",
  ],
  "monitoring.coreos.com/v1/ServiceMonitor": [
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
    "ServiceMonitor",
  ],
};

// kustomize's Kustomization has no published schema in these packages: its top-level fields are
// checked against kustomize's own list, and its resources against the files beside it.
const KUSTOMIZATION = "kustomize.config.k8s.io/v1beta1/Kustomization";
const KUSTOMIZATION_FIELDS = new Set([
  "apiVersion", "kind", "metadata", "resources", "components", "namespace", "namePrefix",
  "nameSuffix", "labels", "commonLabels", "commonAnnotations", "images", "replicas", "patches",
  "configMapGenerator", "secretGenerator", "generatorOptions", "buildMetadata", "openapi",
  "crds", "helmCharts", "replacements", "sortOptions",
]);

// Variables turnstile reads beside its flags (crates/core/src/telemetry.rs), so that
// `consume --help` does not list them; README's settings table does.
const READ_BESIDE_FLAGS = new Set(["RUST_LOG", "TURNSTILE_LOG_FORMAT"]);
// Variables that hold credentials: only in a Secret.
const CREDENTIALS = ["TURNSTILE_AMQP_URL", "TURNSTILE_REDIS_URL", "TURNSTILE_DOWNSTREAM_TOKEN", "TURNSTILE_HTTP_TOKEN"];
// What the Secret must hold.
const SECRET_REQUIRED = ["TURNSTILE_AMQP_URL", "TURNSTILE_REDIS_URL"];
// After TURNSTILE_SHUTDOWN_GRACE the replica closes within this much more (replica.rs: close).
const CLOSE_AFTER_GRACE_SECS = 1;

// --- arguments ------------------------------------------------------------------------------

function parseArgs(argv) {
  const args = { helpFile: null, binary: null, dirs: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--consume-help") args.helpFile = argv[++i];
    else if (a === "--binary") args.binary = argv[++i];
    else if (a === "-h" || a === "--help") {
      console.log("usage: node validate.mjs --consume-help FILE|- [--binary PATH] [DIR...]");
      process.exit(0);
    } else if (a.startsWith("-") && a !== "-") usageError(`unknown option ${a}`);
    else args.dirs.push(a);
  }
  if (!args.helpFile) usageError("--consume-help FILE|- is required (the text of `turnstile consume --help`)");
  if (args.dirs.length === 0) args.dirs.push(path.resolve(here, "../kubernetes"));
  return args;
}

/** The `[env: NAME]` variables of `turnstile consume --help`, each with its `[default: ...]`. */
function parseHelp(text) {
  const vars = new Map();
  // One block per option: from a line starting with `-x, --flag` or `--flag` to the next.
  const blocks = text.split(/\n(?=\s{2,}(?:-\w, )?--[\w-])/);
  for (const block of blocks) {
    const env = /\[env: ([A-Z][A-Z0-9_]*)/.exec(block);
    if (!env) continue;
    const def = /\[default: ([^\]]*)\]/.exec(block);
    vars.set(env[1], def ? def[1] : undefined);
  }
  return vars;
}

// --- YAML files -----------------------------------------------------------------------------

function yamlFiles(dir) {
  if (!fs.existsSync(dir) || !fs.statSync(dir).isDirectory()) usageError(`${dir} is not a directory`);
  const out = [];
  for (const entry of fs.readdirSync(dir, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
    const p = path.join(dir, entry.name);
    if (entry.isDirectory()) out.push(...yamlFiles(p));
    else if (/\.ya?ml$/.test(entry.name)) out.push(p);
  }
  return out;
}

// --- unknown fields, walked along the packages' type declarations -----------------------------

function typeWalker(ts, kinds) {
  const file = path.join(here, "__manifest_types__.ts");
  let source = "";
  kinds.forEach(([module, name], i) => {
    source += `import type { I${name} as T${i} } from "${module}";\nexport declare const k${i}: T${i};\n`;
  });
  const options = {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    types: [],
    target: ts.ScriptTarget.ES2020,
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
  };
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile.bind(host);
  const fileExists = host.fileExists.bind(host);
  host.getSourceFile = (f, language, ...rest) =>
    f === file ? ts.createSourceFile(f, source, language) : getSourceFile(f, language, ...rest);
  host.fileExists = (f) => f === file || fileExists(f);
  const program = ts.createProgram([file], options, host);
  const problems = ts.getPreEmitDiagnostics(program);
  if (problems.length > 0) {
    usageError(
      "the type declarations of the schema packages do not load: " +
        problems.map((d) => ts.flattenDiagnosticMessageText(d.messageText, " ")).join("; "),
    );
  }
  const checker = program.getTypeChecker();
  const exports = checker.getExportsOfModule(checker.getSymbolAtLocation(program.getSourceFile(file)));
  const types = new Map(exports.map((s) => [s.name, checker.getTypeOfSymbol(s)]));

  function walk(value, type, at, out) {
    type = checker.getNonNullableType(type);
    if (type.flags & (ts.TypeFlags.Any | ts.TypeFlags.Unknown)) return;
    const parts = type.isUnion() ? type.types : [type];
    if (Array.isArray(value)) {
      for (const t of parts) {
        const element = t.getNumberIndexType();
        if (element) {
          value.forEach((v, i) => walk(v, element, `${at}[${i}]`, out));
          return;
        }
      }
      return;
    }
    if (value === null || typeof value !== "object") return;
    const objects = parts.filter((t) => t.flags & ts.TypeFlags.Object);
    if (objects.length === 0) return;
    for (const [key, v] of Object.entries(value)) {
      let field = null;
      for (const t of objects) {
        const property = t.getProperty(key);
        if (property) {
          field = checker.getTypeOfSymbol(property);
          break;
        }
        const index = t.getStringIndexType();
        if (index) {
          field = index;
          break;
        }
      }
      const where = at ? `${at}.${key}` : key;
      if (!field) {
        const known = [...new Set(objects.flatMap((t) => t.getProperties().map((s) => s.name)))].sort();
        out.push(`${where}: unknown field (the schema has: ${known.join(", ")})`);
        continue;
      }
      walk(v, field, where, out);
    }
  }
  return (kindIndex, doc) => {
    const out = [];
    walk(doc, types.get(`k${kindIndex}`), "", out);
    return out;
  };
}

// --- turnstile's invariants ---------------------------------------------------------------------

/** turnstile's duration format (crates/core/src/config.rs, parse_duration): seconds, or null. */
function parseDuration(s) {
  const m = /^([0-9.]+)\s*(ms|s|sec|m|min|h|d)?$/.exec(String(s).trim());
  if (!m) return null;
  const n = Number(m[1]);
  const unit = { ms: 0.001, s: 1, sec: 1, m: 60, min: 60, h: 3600, d: 86400 }[m[2] ?? "s"];
  const secs = n * unit;
  return Number.isFinite(secs) && secs > 0 && secs < 1e9 ? secs : null;
}

/** A Kubernetes quantity as a number (cpu in cores, memory in bytes), or null. */
function quantity(q) {
  const m = /^([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$/.exec(String(q));
  if (!m) return null;
  const scale = { m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40 };
  return Number(m[1]) * (m[2] ? scale[m[2]] : 1);
}

const matches = (selector, labels) =>
  !!selector && Object.keys(selector).length > 0 &&
  Object.entries(selector).every(([k, v]) => (labels ?? {})[k] === v);

function checkInvariants(docs, help, binaryText, report) {
  const only = (kind, optional = false) => {
    const found = docs.filter((d) => d.doc.kind === kind);
    if (found.length === 0 && optional) return null;
    if (found.length !== 1) {
      report(null, `expected ${optional ? "at most" : "exactly"} one ${kind} in the manifests, found ${found.length}`);
      return null;
    }
    return found[0];
  };
  const cm = only("ConfigMap");
  const secret = only("Secret");
  const dep = only("Deployment");
  const so = only("ScaledObject");
  const ta = only("TriggerAuthentication");
  const svc = only("Service");
  // Optional: without the Prometheus Operator, the pod annotations take its place (below).
  const sm = only("ServiceMonitor", true);
  const pdb = only("PodDisruptionBudget");
  const kustomizations = docs.filter((d) => d.doc.kind === "Kustomization");

  const config = cm?.doc.data ?? {};
  const secretData = { ...(secret?.doc.data ?? {}), ...(secret?.doc.stringData ?? {}) };
  const setting = (name) => config[name] ?? secretData[name] ?? help.get(name);

  // Every key a variable the binary reads; credentials only in the Secret.
  for (const [d, keys] of [[cm, Object.keys(config)], [secret, Object.keys(secretData)]]) {
    if (!d) continue;
    for (const key of keys) {
      if (help.has(key)) continue;
      if (READ_BESIDE_FLAGS.has(key) && binaryText?.includes(key)) continue;
      const why = READ_BESIDE_FLAGS.has(key)
        ? binaryText ? "the binary does not contain it" : "it is read beside the flags: pass --binary to confirm the binary reads it"
        : "`turnstile consume --help` lists no such [env: ...]";
      report(d, `${key}: not a variable turnstile consume reads (${why})`);
    }
  }
  if (cm) {
    for (const key of CREDENTIALS) {
      if (key in config) report(cm, `${key} holds credentials: put it in the Secret, not the ConfigMap`);
    }
  }
  if (secret) {
    for (const key of SECRET_REQUIRED) {
      if (!secretData[key]) report(secret, `${key} is missing: the Secret must hold the broker's and Redis's URLs`);
    }
    const amqp = secret.doc.stringData?.TURNSTILE_AMQP_URL;
    if (amqp && !/^amqps?:\/\//.test(amqp)) report(secret, `TURNSTILE_AMQP_URL ${JSON.stringify(amqp)} is not an amqp:// or amqps:// URL`);
    const redis = secret.doc.stringData?.TURNSTILE_REDIS_URL;
    if (redis && !/^rediss?:\/\//.test(redis)) report(secret, `TURNSTILE_REDIS_URL ${JSON.stringify(redis)} is not a redis:// or rediss:// URL`);
  }
  if (!setting("TURNSTILE_DOWNSTREAM_URL")) report(cm, "TURNSTILE_DOWNSTREAM_URL is required by turnstile consume and set nowhere");

  const graceText = setting("TURNSTILE_SHUTDOWN_GRACE");
  const grace = graceText === undefined ? null : parseDuration(graceText);
  if (grace === null) report(cm, `TURNSTILE_SHUTDOWN_GRACE ${JSON.stringify(graceText)} is not a duration turnstile accepts (e.g. 8s, 500ms, 1m)`);
  const queue = setting("TURNSTILE_QUEUE");
  const httpAddr = String(setting("TURNSTILE_HTTP_ADDR") ?? "");
  const addr = /^(.*):(\d+)$/.exec(httpAddr);
  if (!addr || !["0.0.0.0", "[::]", ""].includes(addr[1])) {
    report(cm, `TURNSTILE_HTTP_ADDR ${JSON.stringify(httpAddr)} must listen on all interfaces (0.0.0.0:PORT): the probes and Prometheus reach the pod's IP`);
  }
  const httpPort = addr ? Number(addr[2]) : null;

  // The Deployment.
  let podLabels = {};
  if (dep) {
    const spec = dep.doc.spec ?? {};
    const pod = spec.template?.spec ?? {};
    podLabels = spec.template?.metadata?.labels ?? {};
    if (!matches(spec.selector?.matchLabels, podLabels)) report(dep, "spec.selector.matchLabels does not match the pod template's labels");
    const containers = pod.containers ?? [];
    const c = containers.find((x) => [...(x.command ?? []), ...(x.args ?? [])].includes("consume"));
    if (!c) report(dep, "no container runs `turnstile consume` (args: [\"consume\"])");
    const tgps = pod.terminationGracePeriodSeconds ?? 30;
    if (grace !== null && !(tgps > grace + CLOSE_AFTER_GRACE_SECS)) {
      report(
        dep,
        `spec.template.spec.terminationGracePeriodSeconds ${tgps} must exceed TURNSTILE_SHUTDOWN_GRACE ` +
          `(${graceText} = ${grace} s) + ${CLOSE_AFTER_GRACE_SECS} s to close, or the kubelet kills the replica mid-drain`,
      );
    }
    const psc = pod.securityContext ?? {};
    if (c) {
      const at = `spec.template.spec.containers[${containers.indexOf(c)}]`;
      const csc = c.securityContext ?? {};
      const eff = (k) => csc[k] ?? psc[k];
      const port = (c.ports ?? []).find((p) => p.name === "http");
      if (!port) report(dep, `${at}.ports: no port named http`);
      else if (httpPort !== null && port.containerPort !== httpPort) {
        report(dep, `${at}.ports http is ${port.containerPort} but TURNSTILE_HTTP_ADDR listens on ${httpPort}`);
      }
      const probeOk = (probe, pathWanted) =>
        probe?.httpGet?.path === pathWanted &&
        (probe.httpGet.port === "http" || probe.httpGet.port === httpPort);
      if (!probeOk(c.livenessProbe, "/healthz")) report(dep, `${at}.livenessProbe must be an httpGet of /healthz on port http`);
      if (!probeOk(c.readinessProbe, "/readyz")) report(dep, `${at}.readinessProbe must be an httpGet of /readyz on port http`);
      if (eff("runAsNonRoot") !== true) report(dep, `${at}: runAsNonRoot must be true`);
      for (const k of ["runAsUser", "runAsGroup"]) {
        if (!Number.isInteger(eff(k)) || eff(k) <= 0) report(dep, `${at}: ${k} must be a numeric non-root id`);
      }
      if (csc.readOnlyRootFilesystem !== true) report(dep, `${at}.securityContext.readOnlyRootFilesystem must be true`);
      if (csc.allowPrivilegeEscalation !== false) report(dep, `${at}.securityContext.allowPrivilegeEscalation must be false`);
      if (!(csc.capabilities?.drop ?? []).includes("ALL")) report(dep, `${at}.securityContext.capabilities.drop must include ALL`);
      if (eff("seccompProfile")?.type !== "RuntimeDefault") report(dep, `${at}: seccompProfile.type must be RuntimeDefault`);
      for (const r of ["cpu", "memory"]) {
        const req = quantity(c.resources?.requests?.[r]);
        const lim = quantity(c.resources?.limits?.[r]);
        if (req === null || lim === null) report(dep, `${at}.resources: requests and limits of ${r} must both be set`);
        else if (req > lim) report(dep, `${at}.resources: the ${r} request exceeds its limit`);
      }
      const refs = c.envFrom ?? [];
      if (cm && !refs.some((e) => e.configMapRef?.name === cm.doc.metadata?.name)) {
        report(dep, `${at}.envFrom does not name the ConfigMap ${cm.doc.metadata?.name}`);
      }
      if (secret && !refs.some((e) => e.secretRef?.name === secret.doc.metadata?.name)) {
        report(dep, `${at}.envFrom does not name the Secret ${secret.doc.metadata?.name}`);
      }
    }
  }

  // KEDA.
  if (so) {
    const spec = so.doc.spec ?? {};
    const target = spec.scaleTargetRef ?? {};
    if (dep && (target.name !== dep.doc.metadata?.name || (target.kind ?? "Deployment") !== "Deployment")) {
      report(so, `spec.scaleTargetRef must name the Deployment ${dep.doc.metadata?.name} (it names ${target.kind ?? "Deployment"} ${target.name})`);
    }
    const min = spec.minReplicaCount ?? 0;
    const max = spec.maxReplicaCount ?? 100;
    if (min < 1) report(so, "spec.minReplicaCount must be at least 1: the replicas move the delay ladder, so at least one must always run");
    if (max < min) report(so, "spec.maxReplicaCount is below minReplicaCount");
    const rabbit = (spec.triggers ?? []).filter((t) => t.type === "rabbitmq");
    const work = rabbit.find((t) => t.metadata?.queueName === queue);
    if (!work) {
      report(so, `spec.triggers: no rabbitmq trigger on the work queue ${JSON.stringify(queue)} (TURNSTILE_QUEUE); found ${JSON.stringify(rabbit.map((t) => t.metadata?.queueName))}`);
    }
    for (const t of rabbit) {
      const q = t.metadata?.queueName ?? "";
      if (q !== queue && !q.startsWith(`${queue}.`)) report(so, `spec.triggers: queue ${JSON.stringify(q)} is not TURNSTILE_QUEUE ${JSON.stringify(queue)} nor derived from it`);
      if (t.metadata?.mode !== "QueueLength") report(so, `spec.triggers (${q}): mode must be QueueLength`);
      if (!/^[1-9][0-9]*$/.test(t.metadata?.value ?? "")) report(so, `spec.triggers (${q}): value must be a positive whole number of messages`);
      if ("host" in (t.metadata ?? {})) report(so, `spec.triggers (${q}): the broker URL must come from the TriggerAuthentication, not metadata.host`);
      const auth = t.authenticationRef?.name;
      if (!ta || auth !== ta.doc.metadata?.name || (t.authenticationRef?.kind ?? "TriggerAuthentication") !== "TriggerAuthentication") {
        report(so, `spec.triggers (${q}): authenticationRef must name the TriggerAuthentication ${ta?.doc.metadata?.name}`);
      }
    }
  }
  if (ta) {
    const host = (ta.doc.spec?.secretTargetRef ?? []).find((r) => r.parameter === "host");
    if (!host || host.name !== secret?.doc.metadata?.name || host.key !== "TURNSTILE_AMQP_URL") {
      report(ta, `spec.secretTargetRef must give parameter host from the Secret ${secret?.doc.metadata?.name}, key TURNSTILE_AMQP_URL`);
    }
  }

  // Monitoring and disruption.
  if (svc) {
    if (!matches(svc.doc.spec?.selector, podLabels)) report(svc, "spec.selector does not select the Deployment's pods");
    const p = (svc.doc.spec?.ports ?? []).find((x) => x.name === "http");
    if (!p || !(p.targetPort === "http" || p.targetPort === httpPort)) report(svc, "spec.ports: a port named http with targetPort http is required");
  }
  if (sm) {
    if (svc && !matches(sm.doc.spec?.selector?.matchLabels, svc.doc.metadata?.labels)) report(sm, `spec.selector does not select the Service ${svc.doc.metadata?.name}`);
    const e = (sm.doc.spec?.endpoints ?? []).find((x) => x.port === "http");
    if (!e || (e.path ?? "/metrics") !== "/metrics") report(sm, "spec.endpoints: an endpoint on port http, path /metrics, is required");
  }
  // Scraped exactly once: by the ServiceMonitor (through the Service) or, without the Prometheus
  // Operator, by a Prometheus honouring the pods' prometheus.io/* annotations. Both would scrape
  // every replica twice (a Prometheus may do both), doubling every sum().
  if (dep) {
    const ann = dep.doc.spec?.template?.metadata?.annotations ?? {};
    const annotated = ann["prometheus.io/scrape"] === "true";
    const smScrapes = !!sm && !!svc &&
      matches(sm.doc.spec?.selector?.matchLabels, svc.doc.metadata?.labels) &&
      matches(svc.doc.spec?.selector, podLabels);
    if (annotated && smScrapes) {
      report(
        dep,
        `spec.template.metadata.annotations: prometheus.io/scrape "true" on pods that the ServiceMonitor ${sm.doc.metadata?.name} ` +
          `(${path.basename(sm.file)}, through the Service ${svc.doc.metadata?.name}) also scrapes: every replica would be scraped twice ` +
          "and every sum() doubled; keep one: the ServiceMonitor with the Prometheus Operator, else the annotations without servicemonitor.yaml",
      );
    } else if (annotated) {
      if (ann["prometheus.io/port"] !== String(httpPort) || (ann["prometheus.io/path"] ?? "/metrics") !== "/metrics") {
        report(dep, `spec.template.metadata.annotations: with prometheus.io/scrape "true", prometheus.io/port must be "${httpPort}" and prometheus.io/path /metrics`);
      }
    } else if (!sm) {
      report(
        dep,
        "nothing scrapes the replicas' /metrics: keep servicemonitor.yaml (with service.yaml) for the Prometheus Operator, or, without it, " +
          `give the pod template the annotations prometheus.io/scrape "true", prometheus.io/port "${httpPort}" and prometheus.io/path /metrics`,
      );
    }
  }
  if (pdb && !matches(pdb.doc.spec?.selector?.matchLabels, podLabels)) report(pdb, "spec.selector does not select the Deployment's pods");

  // The kustomization applies every file beside it but the Secret's (secret.yaml): that one holds
  // placeholders, and `kubectl apply -k` would overwrite the real Secret, created out of band,
  // with them. It is filled in and applied by hand, and validated above all the same.
  const secretFiles = new Set(docs.filter((d) => d.doc.kind === "Secret").map((d) => d.file));
  for (const f of secretFiles) {
    const others = docs.filter((d) => d.file === f && d.doc.kind !== "Secret").map((d) => d.doc.kind);
    if (others.length > 0) {
      report(docs.find((d) => d.file === f && d.doc.kind === "Secret"), `${path.basename(f)} must hold only the Secret (it also holds ${others.join(", ")}): it stays out of the kustomization, the rest goes in`);
    }
  }
  for (const k of kustomizations) {
    const dir = path.dirname(k.file);
    const listed = new Set((k.doc.resources ?? []).map((r) => path.resolve(dir, r)));
    for (const d of new Set(docs.map((x) => x.file))) {
      if (d === k.file || path.dirname(d) !== dir) continue;
      if (secretFiles.has(d)) {
        if (listed.has(d)) {
          report(k, `resources lists ${path.basename(d)}, the Secret's template: \`kubectl apply -k\` would overwrite the real credentials with its placeholders; leave it out and apply the filled file by hand (kubectl apply -f)`);
        }
      } else if (!listed.has(d)) report(k, `resources does not list ${path.basename(d)}`);
    }
    for (const r of listed) if (!fs.existsSync(r)) report(k, `resources lists ${path.relative(dir, r)}, which does not exist`);
  }
}

// --- main -------------------------------------------------------------------------------------

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const helpText = fs.readFileSync(args.helpFile === "-" ? 0 : args.helpFile, "utf8");
  const help = parseHelp(helpText);
  if (!help.has("TURNSTILE_QUEUE") || !help.has("TURNSTILE_SHUTDOWN_GRACE")) {
    usageError("--consume-help does not look like `turnstile consume --help` (no [env: TURNSTILE_QUEUE=])");
  }
  const binaryText = args.binary ? fs.readFileSync(args.binary).toString("latin1") : null;

  const yaml = (await load("js-yaml")).default;
  const ts = (await load("typescript")).default;
  const kinds = Object.entries(KINDS);
  const models = new Map();
  for (const [key, [module, name]] of kinds) models.set(key, (await load(module))[name]);
  const unknownFields = typeWalker(ts, kinds.map(([, v]) => v));

  const cwd = process.cwd();
  const docs = [];
  let failures = 0;
  const shown = (f) => (path.relative(cwd, f).startsWith("..") ? f : path.relative(cwd, f) || ".");
  const label = (d) => `${shown(d.file)}: ${[d.doc?.kind ?? "?", d.doc?.metadata?.name].filter(Boolean).join(" ")}`;
  const report = (d, message) => {
    failures++;
    console.log(`FAIL ${d ? label(d) : "manifests"}: ${message}`);
  };

  const files = args.dirs.flatMap(yamlFiles);
  if (files.length === 0) usageError(`no YAML files under ${args.dirs.join(", ")}`);
  for (const file of files) {
    let parsed;
    try {
      parsed = yaml.loadAll(fs.readFileSync(file, "utf8"), null, { filename: file });
    } catch (error) {
      report({ file, doc: null }, `not valid YAML: ${error.message}`);
      continue;
    }
    parsed.forEach((doc, i) => {
      if (doc === null || doc === undefined) return;
      const d = { file, doc, index: i };
      if (typeof doc !== "object" || Array.isArray(doc)) return report(d, "a document must be a mapping");
      docs.push(d);
      const key = `${doc.apiVersion}/${doc.kind}`;
      if (key === KUSTOMIZATION) {
        for (const field of Object.keys(doc)) if (!KUSTOMIZATION_FIELDS.has(field)) report(d, `${field}: unknown field of a Kustomization`);
        if (!Array.isArray(doc.resources)) report(d, "resources must be a list");
        console.log(`ok   ${label(d)} (kustomize's fields; resources checked below)`);
        return;
      }
      const Model = models.get(key);
      if (!Model) {
        return report(d, `unknown kind ${doc.kind} of apiVersion ${doc.apiVersion}: no schema for it (known: ${[...models.keys(), KUSTOMIZATION].join(", ")})`);
      }
      let problems = 0;
      try {
        new Model(doc).validate();
      } catch (error) {
        problems++;
        report(d, `schema: ${String(error.message).replace(/^data\/?/, "").replace(/\ndata\/?/g, "; ")}`);
      }
      for (const problem of unknownFields(kinds.findIndex(([k]) => k === key), doc)) {
        problems++;
        report(d, problem);
      }
      if (problems === 0) console.log(`ok   ${label(d)}`);
    });
  }
  const before = failures;
  checkInvariants(docs, help, binaryText, report);
  if (failures === before) console.log(`ok   turnstile's checks across the ${docs.length} documents`);
  const summary = `${docs.length} documents in ${files.length} files under ${args.dirs.map(shown).join(", ")}`;
  if (failures > 0) {
    console.log(`${failures} problem(s) in ${summary}`);
    process.exit(1);
  }
  console.log(`all valid: ${summary}`);
}

await main();
