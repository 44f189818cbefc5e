//! Renders a crate's public API, one item per line, sorted, from the
//! rustdoc JSON of the crate (`.ci/public-api` makes it and compares the
//! lines with the committed snapshot in `api/`, so that an API change is a
//! visible diff in review).
//!
//! `public-api TARGET/doc/CRATE.json` prints the lines to stdout. Each line
//! is one public item at a path where users can name it: modules, types
//! with their public fields and variants, functions with their signatures,
//! traits with their items, constants with their types, re-exports of other
//! crates' items, the inherent methods of public types and the traits they
//! implement (auto traits and blanket impls left out). `#[doc(hidden)]`
//! items are not in the JSON. The JSON's format is rustdoc's, unstable:
//! this reads the version `FORMAT_VERSION` says and refuses others.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::process::ExitCode;

use serde_json::Value;

/// The rustdoc JSON `format_version` this renderer reads.
const FORMAT_VERSION: u64 = 57;

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: public-api TARGET/doc/CRATE.json");
        return ExitCode::FAILURE;
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("public-api: cannot read {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let doc: Value = match serde_json::from_str(&text) {
        Ok(doc) => doc,
        Err(e) => {
            eprintln!("public-api: {path} is not JSON: {e}");
            return ExitCode::FAILURE;
        }
    };
    let version = doc["format_version"].as_u64().unwrap_or(0);
    if version != FORMAT_VERSION {
        eprintln!(
            "public-api: {path} has rustdoc JSON format {version}; this renderer reads \
             {FORMAT_VERSION} (the toolchain changed: update the renderer)"
        );
        return ExitCode::FAILURE;
    }
    let mut api = Api {
        doc: &doc,
        lines: BTreeSet::new(),
        visiting: HashSet::new(),
        canonical: HashMap::new(),
    };
    let root = doc["root"].to_string();
    let name = api.item(&root)["name"].as_str().unwrap_or("?").to_owned();
    api.canonical.insert(root.clone(), name.clone());
    api.collect(&root, &name);
    api.module(&root, &name);
    for line in &api.lines {
        println!("{line}");
    }
    ExitCode::SUCCESS
}

struct Api<'a> {
    doc: &'a Value,
    lines: BTreeSet<String>,
    /// Modules being walked, so that a glob re-export cycle ends.
    visiting: HashSet<String>,
    /// Each local item's shortest public path: where its items are listed,
    /// and how other items name it. Other paths are listed as `pub use`.
    canonical: HashMap<String, String>,
}

fn id_of(v: &Value) -> String {
    v.to_string()
}

impl<'a> Api<'a> {
    fn item(&self, id: &str) -> &'a Value {
        &self.doc["index"][id]
    }

    /// Finds every local item's public paths, keeping the shortest (then
    /// the first in byte order).
    fn collect(&mut self, id: &str, path: &str) {
        if !self.visiting.insert(id.to_owned()) {
            return;
        }
        let items: Vec<String> = self.item(id)["inner"]["module"]["items"]
            .as_array()
            .map(|a| a.iter().map(id_of).collect())
            .unwrap_or_default();
        for child in items {
            let mut target = child.clone();
            let mut name = self.item(&child)["name"].as_str().map(str::to_owned);
            let inner = &self.item(&child)["inner"];
            if let Some(u) = inner.get("use") {
                target = id_of(&u["id"]);
                if self.item(&target).is_null() {
                    continue;
                }
                if u["is_glob"] == true {
                    self.collect(&target, path);
                    continue;
                }
                name = u["name"].as_str().map(str::to_owned);
            }
            let Some(name) = name else { continue };
            let full = format!("{path}::{name}");
            let better = match self.canonical.get(&target) {
                None => true,
                Some(old) => {
                    let (a, b) = (full.matches("::").count(), old.matches("::").count());
                    a < b || (a == b && full < *old)
                }
            };
            if better {
                self.canonical.insert(target.clone(), full.clone());
            }
            if self.item(&target)["inner"].get("module").is_some() {
                self.collect(&target, &full);
            }
        }
        self.visiting.remove(id);
    }

    fn module(&mut self, id: &str, path: &str) {
        if !self.visiting.insert(id.to_owned()) {
            return;
        }
        let items: Vec<String> = self.item(id)["inner"]["module"]["items"]
            .as_array()
            .map(|a| a.iter().map(id_of).collect())
            .unwrap_or_default();
        for child in items {
            self.member(&child, path, None);
        }
        self.visiting.remove(id);
    }

    /// An item of a module at `path`, under `name` when re-exported.
    fn member(&mut self, id: &str, path: &str, name: Option<&str>) {
        let item = self.item(id);
        if item.is_null() {
            return;
        }
        let name = name.or(item["name"].as_str()).unwrap_or("?");
        let full = format!("{path}::{name}");
        let inner = &item["inner"];
        let Some((kind, body)) = inner.as_object().and_then(|o| o.iter().next()) else {
            return;
        };
        if kind != "use" {
            if let Some(canonical) = self.canonical.get(id) {
                if *canonical != full {
                    self.lines.insert(format!("pub use {full} = {canonical}"));
                    return;
                }
            }
        }
        match kind.as_str() {
            "use" => {
                let target = id_of(&body["id"]);
                let local = !body["id"].is_null() && !self.item(&target).is_null();
                let glob = body["is_glob"].as_bool().unwrap_or(false);
                let source = body["source"].as_str().unwrap_or("?");
                match (local, glob) {
                    (true, true) => self.module(&target, path),
                    (true, false) => self.member(&target, path, body["name"].as_str()),
                    (false, true) => {
                        self.lines
                            .insert(format!("pub use {path}::* = {source}::*"));
                    }
                    (false, false) => {
                        let name = body["name"].as_str().unwrap_or("?");
                        self.lines
                            .insert(format!("pub use {path}::{name} = {source}"));
                    }
                }
            }
            "module" => {
                self.lines.insert(format!("pub mod {full}"));
                self.module(id, &full);
            }
            "struct" => {
                let generics = self.generics(&body["generics"]);
                self.lines.insert(format!("pub struct {full}{generics}"));
                let kind = &body["kind"];
                let fields: Vec<Value> = kind["plain"]["fields"]
                    .as_array()
                    .or(kind["tuple"].as_array())
                    .cloned()
                    .unwrap_or_default();
                for field in fields.iter().filter(|f| !f.is_null()) {
                    let f = self.item(&id_of(field));
                    if f["visibility"] == "public" {
                        let ty = self.ty(&f["inner"]["struct_field"]);
                        let fname = f["name"].as_str().unwrap_or("?");
                        self.lines.insert(format!("pub {full}::{fname}: {ty}"));
                    }
                }
                self.impls(&body["impls"], &full);
            }
            "enum" => {
                let generics = self.generics(&body["generics"]);
                self.lines.insert(format!("pub enum {full}{generics}"));
                for variant in body["variants"].as_array().into_iter().flatten() {
                    let v = self.item(&id_of(variant));
                    let vname = v["name"].as_str().unwrap_or("?");
                    let fields = match &v["inner"]["variant"]["kind"] {
                        Value::Object(o) if o.contains_key("tuple") => {
                            let tys: Vec<String> = o["tuple"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .filter(|f| !f.is_null())
                                .map(|f| self.ty(&self.item(&id_of(f))["inner"]["struct_field"]))
                                .collect();
                            format!("({})", tys.join(", "))
                        }
                        Value::Object(o) if o.contains_key("struct") => {
                            let fs: Vec<String> = o["struct"]["fields"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .map(|f| {
                                    let f = self.item(&id_of(f));
                                    format!(
                                        "{}: {}",
                                        f["name"].as_str().unwrap_or("?"),
                                        self.ty(&f["inner"]["struct_field"])
                                    )
                                })
                                .collect();
                            format!(" {{ {} }}", fs.join(", "))
                        }
                        _ => String::new(),
                    };
                    self.lines.insert(format!("pub {full}::{vname}{fields}"));
                }
                self.impls(&body["impls"], &full);
            }
            "union" => {
                self.lines.insert(format!("pub union {full}"));
                self.impls(&body["impls"], &full);
            }
            "function" => {
                let f = self.function(name, body);
                let f = f.replacen(&format!("fn {name}"), &format!("fn {full}"), 1);
                self.lines.insert(format!("pub {f}"));
            }
            "trait" => {
                let generics = self.generics(&body["generics"]);
                let bounds = self.bounds(&body["bounds"]);
                let bounds = if bounds.is_empty() {
                    String::new()
                } else {
                    format!(": {bounds}")
                };
                let unsafety = if body["is_unsafe"] == true {
                    "unsafe "
                } else {
                    ""
                };
                self.lines
                    .insert(format!("pub {unsafety}trait {full}{generics}{bounds}"));
                for member in body["items"].as_array().into_iter().flatten() {
                    if let Some(line) = self.assoc(&id_of(member)) {
                        self.lines.insert(format!("{full}: {line}"));
                    }
                }
            }
            "trait_alias" => {
                self.lines.insert(format!("pub trait {full} = …"));
            }
            "type_alias" => {
                let generics = self.generics(&body["generics"]);
                let ty = self.ty(&body["type"]);
                self.lines
                    .insert(format!("pub type {full}{generics} = {ty}"));
            }
            "constant" => {
                let ty = self.ty(&body["type"]);
                self.lines.insert(format!("pub const {full}: {ty}"));
            }
            "static" => {
                let ty = self.ty(&body["type"]);
                let m = if body["is_mutable"] == true {
                    "mut "
                } else {
                    ""
                };
                self.lines.insert(format!("pub static {m}{full}: {ty}"));
            }
            "macro" => {
                self.lines.insert(format!("pub macro {full}!"));
            }
            "proc_macro" => {
                let kind = body["kind"].as_str().unwrap_or("?");
                self.lines.insert(format!("pub proc_macro({kind}) {full}"));
            }
            "extern_crate" => {
                self.lines.insert(format!("pub extern crate {full}"));
            }
            other => {
                self.lines.insert(format!("pub {other} {full}"));
            }
        }
    }

    /// The inherent items and trait impls of a type at `full`.
    fn impls(&mut self, impls: &Value, full: &str) {
        for id in impls.as_array().into_iter().flatten() {
            let imp = &self.item(&id_of(id))["inner"]["impl"];
            if imp.is_null() || imp["is_synthetic"] == true || !imp["blanket_impl"].is_null() {
                continue;
            }
            let generics = self.generics(&imp["generics"]);
            let wheres = self.wheres(&imp["generics"]);
            if imp["trait"].is_null() {
                for member in imp["items"].as_array().into_iter().flatten() {
                    let m = self.item(&id_of(member));
                    if m["visibility"] != "public" {
                        continue;
                    }
                    if let Some(line) = self.assoc(&id_of(member)) {
                        self.lines
                            .insert(format!("impl{generics} {full}{wheres}: pub {line}"));
                    }
                }
            } else {
                let neg = if imp["is_negative"] == true { "!" } else { "" };
                let tr = self.path(&imp["trait"]);
                let for_ty = self.ty(&imp["for"]);
                self.lines
                    .insert(format!("impl{generics} {neg}{tr} for {for_ty}{wheres}"));
            }
        }
    }

    /// A trait's or an impl's item.
    fn assoc(&self, id: &str) -> Option<String> {
        let item = self.item(id);
        let name = item["name"].as_str()?;
        let (kind, body) = item["inner"].as_object()?.iter().next()?;
        Some(match kind.as_str() {
            "function" => self.function(name, body),
            "assoc_const" => format!("const {name}: {}", self.ty(&body["type"])),
            "assoc_type" => {
                let bounds = self.bounds(&body["bounds"]);
                let mut s = format!("type {name}");
                if !bounds.is_empty() {
                    s.push_str(&format!(": {bounds}"));
                }
                if !body["type"].is_null() {
                    s.push_str(&format!(" = {}", self.ty(&body["type"])));
                }
                s
            }
            other => format!("{other} {name}"),
        })
    }

    fn function(&self, name: &str, body: &Value) -> String {
        let header = &body["header"];
        let mut s = String::new();
        if header["is_const"] == true {
            s.push_str("const ");
        }
        if header["is_async"] == true {
            s.push_str("async ");
        }
        if header["is_unsafe"] == true {
            s.push_str("unsafe ");
        }
        s.push_str("fn ");
        s.push_str(name);
        s.push_str(&self.generics(&body["generics"]));
        let inputs: Vec<String> = body["sig"]["inputs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|input| {
                let arg = input[0].as_str().unwrap_or("_");
                let ty = &input[1];
                match (arg, ty) {
                    ("self", Value::Object(o)) if o.get("generic") == Some(&"Self".into()) => {
                        "self".to_owned()
                    }
                    ("self", _) => {
                        let rendered = self.ty(ty);
                        match rendered.strip_suffix("Self").filter(|r| r.starts_with('&')) {
                            Some(r) => format!("{r}self"),
                            None => format!("self: {rendered}"),
                        }
                    }
                    _ => format!("{arg}: {}", self.ty(ty)),
                }
            })
            .collect();
        s.push_str(&format!("({})", inputs.join(", ")));
        if !body["sig"]["output"].is_null() {
            s.push_str(&format!(" -> {}", self.ty(&body["sig"]["output"])));
        }
        s.push_str(&self.wheres(&body["generics"]));
        s
    }

    fn generics(&self, g: &Value) -> String {
        let params: Vec<String> = g["params"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["kind"]["type"]["is_synthetic"] != true)
            .map(|p| {
                let name = p["name"].as_str().unwrap_or("?");
                let kind = &p["kind"];
                if let Some(l) = kind.get("lifetime") {
                    let outlives: Vec<&str> = l["outlives"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .collect();
                    if outlives.is_empty() {
                        name.to_owned()
                    } else {
                        format!("{name}: {}", outlives.join(" + "))
                    }
                } else if let Some(t) = kind.get("type") {
                    let bounds = self.bounds(&t["bounds"]);
                    let mut s = name.to_owned();
                    if !bounds.is_empty() {
                        s.push_str(&format!(": {bounds}"));
                    }
                    if !t["default"].is_null() {
                        s.push_str(&format!(" = {}", self.ty(&t["default"])));
                    }
                    s
                } else if let Some(c) = kind.get("const") {
                    format!("const {name}: {}", self.ty(&c["type"]))
                } else {
                    name.to_owned()
                }
            })
            .collect();
        if params.is_empty() {
            String::new()
        } else {
            format!("<{}>", params.join(", "))
        }
    }

    fn wheres(&self, g: &Value) -> String {
        let preds: Vec<String> = g["where_predicates"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                if let Some(b) = p.get("bound_predicate") {
                    format!("{}: {}", self.ty(&b["type"]), self.bounds(&b["bounds"]))
                } else if let Some(l) = p.get("lifetime_predicate") {
                    let outlives: Vec<&str> = l["outlives"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .collect();
                    format!(
                        "{}: {}",
                        l["lifetime"].as_str().unwrap_or("?"),
                        outlives.join(" + ")
                    )
                } else if let Some(e) = p.get("eq_predicate") {
                    format!("{} = …", self.ty(&e["lhs"]))
                } else {
                    "?".to_owned()
                }
            })
            .collect();
        if preds.is_empty() {
            String::new()
        } else {
            format!(" where {}", preds.join(", "))
        }
    }

    fn bounds(&self, bounds: &Value) -> String {
        let parts: Vec<String> = bounds
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| {
                if let Some(t) = b.get("trait_bound") {
                    let modifier = match t["modifier"].as_str() {
                        Some("maybe") => "?",
                        Some("maybe_const") => "~const ",
                        _ => "",
                    };
                    format!("{modifier}{}", self.path(&t["trait"]))
                } else if let Some(l) = b.get("outlives") {
                    l.as_str().unwrap_or("?").to_owned()
                } else {
                    "use<…>".to_owned()
                }
            })
            .collect();
        parts.join(" + ")
    }

    /// A path to an item: its public path for a local item, its full path
    /// for another crate's when rustdoc knows it.
    fn path(&self, p: &Value) -> String {
        let id = id_of(&p["id"]);
        if let Some(public) = self.canonical.get(&id) {
            return format!("{public}{}", self.args(&p["args"]));
        }
        let known = &self.doc["paths"][&id]["path"];
        let base = match known.as_array() {
            Some(segments) if !segments.is_empty() => segments
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("::"),
            _ => p["path"].as_str().unwrap_or("?").to_owned(),
        };
        format!("{base}{}", self.args(&p["args"]))
    }

    fn args(&self, args: &Value) -> String {
        if args.is_null() {
            return String::new();
        }
        if let Some(a) = args.get("angle_bracketed") {
            let mut parts: Vec<String> = a["args"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|arg| {
                    if let Some(l) = arg.get("lifetime") {
                        l.as_str().unwrap_or("?").to_owned()
                    } else if let Some(t) = arg.get("type") {
                        self.ty(t)
                    } else if let Some(c) = arg.get("const") {
                        c["expr"].as_str().unwrap_or("?").to_owned()
                    } else {
                        "_".to_owned()
                    }
                })
                .collect();
            for c in a["constraints"].as_array().into_iter().flatten() {
                let name = c["name"].as_str().unwrap_or("?");
                let binding = &c["binding"];
                if let Some(eq) = binding.get("equality") {
                    let value = eq
                        .get("type")
                        .map(|t| self.ty(t))
                        .unwrap_or_else(|| "…".to_owned());
                    parts.push(format!("{name} = {value}"));
                } else if let Some(b) = binding.get("constraint") {
                    parts.push(format!("{name}: {}", self.bounds(b)));
                }
            }
            if parts.is_empty() {
                String::new()
            } else {
                format!("<{}>", parts.join(", "))
            }
        } else if let Some(p) = args.get("parenthesized") {
            let inputs: Vec<String> = p["inputs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| self.ty(t))
                .collect();
            let output = if p["output"].is_null() {
                String::new()
            } else {
                format!(" -> {}", self.ty(&p["output"]))
            };
            format!("({}){output}", inputs.join(", "))
        } else {
            "(..)".to_owned()
        }
    }

    fn ty(&self, t: &Value) -> String {
        let Some((kind, v)) = t.as_object().and_then(|o| o.iter().next()) else {
            return "?".to_owned();
        };
        match kind.as_str() {
            "resolved_path" => self.path(v),
            "generic" | "primitive" => v.as_str().unwrap_or("?").to_owned(),
            "borrowed_ref" => {
                let lifetime = v["lifetime"]
                    .as_str()
                    .map(|l| format!("{l} "))
                    .unwrap_or_default();
                let m = if v["is_mutable"] == true { "mut " } else { "" };
                format!("&{lifetime}{m}{}", self.ty(&v["type"]))
            }
            "raw_pointer" => {
                let m = if v["is_mutable"] == true {
                    "mut"
                } else {
                    "const"
                };
                format!("*{m} {}", self.ty(&v["type"]))
            }
            "tuple" => {
                let tys: Vec<String> = v
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| self.ty(t))
                    .collect();
                format!("({})", tys.join(", "))
            }
            "slice" => format!("[{}]", self.ty(v)),
            "array" => format!(
                "[{}; {}]",
                self.ty(&v["type"]),
                v["len"].as_str().unwrap_or("?")
            ),
            "impl_trait" => format!("impl {}", self.bounds(v)),
            "dyn_trait" => {
                let traits: Vec<String> = v["traits"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| self.path(&p["trait"]))
                    .collect();
                let mut s = format!("dyn {}", traits.join(" + "));
                if let Some(l) = v["lifetime"].as_str() {
                    s.push_str(&format!(" + {l}"));
                }
                s
            }
            "qualified_path" => {
                let self_ty = self.ty(&v["self_type"]);
                let name = v["name"].as_str().unwrap_or("?");
                if v["trait"].is_null() {
                    format!("{self_ty}::{name}")
                } else {
                    format!("<{self_ty} as {}>::{name}", self.path(&v["trait"]))
                }
            }
            "function_pointer" => {
                let inputs: Vec<String> = v["sig"]["inputs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|i| self.ty(&i[1]))
                    .collect();
                let output = if v["sig"]["output"].is_null() {
                    String::new()
                } else {
                    format!(" -> {}", self.ty(&v["sig"]["output"]))
                };
                format!("fn({}){output}", inputs.join(", "))
            }
            "infer" => "_".to_owned(),
            other => format!("<{other}>"),
        }
    }
}
