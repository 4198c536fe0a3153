#!/usr/bin/env node
// YAML -> JSON and Kubernetes schema validation for tests/deploy.
//
//   node validate_k8s.cjs yaml2json FILE            prints the documents of FILE as a JSON array
//   node validate_k8s.cjs validate FILE [FILE...]   validates every object, prints a JSON report
//
// `validate` checks each object twice:
//   1. against the OpenAPI schemas compiled into the npm packages
//      kubernetes-models (Kubernetes 1.31 API) and
//      @kubernetes-models/prometheus-operator (monitoring.coreos.com/v1):
//      types, required fields, enums and patterns the schemas carry;
//   2. with the TypeScript compiler against the same packages' interfaces,
//      each object written as an object literal of its interface type, so
//      that excess-property checks catch unknown (misspelt) fields at any
//      depth, which the JSON schemas let through (they allow additional
//      properties), and string-union types catch bad enum values.
// The modules come from NODE_PATH (the npm ci'd folder in the build tree,
// tests/deploy/CMakeLists.txt); the TypeScript check runs in a scratch folder
// inside that node_modules' parent, where module resolution finds them.
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { execFileSync } = require("child_process");
const YAML = require("yaml");

// YAML 1.1, as Kubernetes (go-yaml) and Prometheus read it: `yes`/`on` are
// booleans there, so a value the `yaml` package's default 1.2 would keep as a
// string must not pass here.
function parseYamlFile(file) {
  const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"), { version: "1.1" });
  const out = [];
  for (const d of docs) {
    if (d.errors && d.errors.length) {
      throw new Error(`${file}: ${d.errors.map((e) => e.message).join("; ")}`);
    }
    const v = d.toJS({ maxAliasCount: 100 });
    if (v !== null && v !== undefined) out.push(v);
  }
  return out;
}

// apiVersion + kind -> [module path, interface name, runtime model]
function modelFor(obj) {
  const { apiVersion, kind } = obj;
  if (typeof apiVersion !== "string" || typeof kind !== "string") {
    throw new Error(`object without apiVersion/kind: ${JSON.stringify(obj).slice(0, 200)}`);
  }
  let mod;
  if (apiVersion === "monitoring.coreos.com/v1") {
    mod = "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
  } else if (/^[a-z0-9.]*\/?v[0-9a-z]+$/.test(apiVersion)) {
    mod = `kubernetes-models/${apiVersion}`;
  } else {
    throw new Error(`no model for apiVersion ${apiVersion}`);
  }
  let Model;
  try {
    Model = require(`${mod}/${kind}`)[kind];
  } catch (e) {
    throw new Error(`no model for ${apiVersion} ${kind} (${mod}/${kind}): ${e.message}`);
  }
  if (!Model) throw new Error(`no model class ${kind} in ${mod}/${kind}`);
  return { module: `${mod}/${kind}`, iface: `I${kind}`, Model };
}

function describe(obj) {
  return `${obj.kind}/${(obj.metadata && obj.metadata.name) || "?"}`;
}

function schemaErrors(obj, model) {
  try {
    new model.Model(obj).validate();
    return [];
  } catch (e) {
    const errs = (e.errors || []).map((x) => `${x.instancePath || "/"} ${x.message}` +
      (x.params && x.params.additionalProperty ? ` (${x.params.additionalProperty})` : ""));
    return errs.length ? errs : [String(e.message || e)];
  }
}

// Every object as `const oN: IKind = <json>;` in one file; tsc --noEmit
// reports excess properties and type mismatches with the object's index.
function typeErrors(objects) {
  const nodePath = (process.env.NODE_PATH || "").split(path.delimiter).filter(Boolean)[0];
  if (!nodePath) throw new Error("NODE_PATH must name the npm ci'd node_modules folder");
  const tsc = path.join(nodePath, "typescript", "bin", "tsc");
  const dir = fs.mkdtempSync(path.join(path.dirname(nodePath), ".tscheck-"));
  try {
    const lines = [];
    const imports = new Map();
    objects.forEach(({ obj, model }, i) => {
      if (!imports.has(model.module)) imports.set(model.module, `T${imports.size}`);
      lines.push(`// ${i}: ${describe(obj)}`);
      lines.push(`export const o${i}: ${imports.get(model.module)}.${model.iface} = ${JSON.stringify(obj, null, 2)};`);
    });
    const header = [...imports].map(([m, alias]) => `import type * as ${alias} from "${m}";`);
    const file = path.join(dir, "objects.ts");
    fs.writeFileSync(file, header.concat(lines).join("\n") + "\n");
    try {
      execFileSync(process.execPath, [tsc, "--noEmit", "--strict", "--skipLibCheck", "--target", "es2020",
        "--module", "commonjs", "--moduleResolution", "node", file],
      { cwd: dir, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
      return [];
    } catch (e) {
      const text = `${e.stdout || ""}${e.stderr || ""}`.trim();
      // Map "objects.ts(LINE,COL): error ..." back to the object it is in.
      const src = fs.readFileSync(file, "utf8").split("\n");
      return text.split("\n").filter((l) => l.trim()).map((l) => {
        const m = l.match(/objects\.ts\((\d+),\d+\)/);
        if (!m) return l;
        for (let n = Number(m[1]) - 1; n >= 0; n--) {
          const c = src[n].match(/^\/\/ (\d+): (.*)$/);
          if (c) return `${c[2]}: ${l.replace(/^.*objects\.ts/, "objects.ts").slice(0, 400)} | ${src[Number(m[1]) - 1].trim()}`;
        }
        return l;
      });
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

function main(argv) {
  const [cmd, ...files] = argv;
  if (cmd === "yaml2json" && files.length === 1) {
    process.stdout.write(JSON.stringify(parseYamlFile(files[0])) + "\n");
    return 0;
  }
  if (cmd !== "validate" || files.length === 0) {
    process.stderr.write("usage: validate_k8s.cjs yaml2json FILE | validate FILE...\n");
    return 2;
  }
  const report = { objects: [], errors: [] };
  const typed = [];
  for (const file of files) {
    let docs;
    try {
      docs = parseYamlFile(file);
    } catch (e) {
      report.errors.push(`${file}: ${e.message}`);
      continue;
    }
    for (const obj of docs) {
      let model;
      try {
        model = modelFor(obj);
      } catch (e) {
        report.errors.push(`${file}: ${e.message}`);
        continue;
      }
      const errs = schemaErrors(obj, model);
      report.objects.push({ file, object: describe(obj), schema: errs.length ? "invalid" : "ok" });
      for (const e of errs) report.errors.push(`${file}: ${describe(obj)}: schema: ${e}`);
      typed.push({ obj, model });
    }
  }
  if (typed.length) {
    for (const e of typeErrors(typed)) report.errors.push(`types: ${e}`);
  }
  process.stdout.write(JSON.stringify(report, null, 2) + "\n");
  return report.errors.length ? 1 : 0;
}

process.exitCode = main(process.argv.slice(2));
