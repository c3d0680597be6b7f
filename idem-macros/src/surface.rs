//! `idem_runtime::__private` is what this crate's expansions (and the
//! runtime's own `__idem_*` macros) name, and nothing else: a test expands
//! every case of the attribute (this crate's trybuild cases in tests/ui, the
//! root package's supported shapes in tests/attribute_shapes) and compares the
//! names the code it emits reaches with the module's exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use proc_macro2::TokenStream;
use quote::ToTokens;

/// Exports that no expansion names, because they are reached through the
/// signatures of exports that one does: the bound `fingerprint_body` and the
/// probes check (named by its diagnostics), the tags the probes' methods
/// return, and what those return.
const REACHED_THROUGH_SIGNATURES: &[&str] = &[
    "BodyShape",
    "BodyLeftOut",
    "BodyNamed",
    "IsBody",
    "ReadsBody",
    "NotBody",
    "Unplaced",
    "PlacedExtractor",
    "ResultTag",
    "PlainTag",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The names that follow `__private ::` in `code` (one, or a `{ .. }` group).
fn named_after_private(code: &str, names: &mut BTreeSet<String>) {
    let words: Vec<&str> = code.split_whitespace().collect();
    for (i, w) in words.iter().enumerate() {
        if !w.ends_with("__private") || words.get(i + 1) != Some(&"::") {
            continue;
        }
        match words.get(i + 2) {
            Some(&"{") => {
                for w in words[i + 3..].iter().take_while(|w| **w != "}") {
                    if !matches!(*w, "as" | "_" | ",") {
                        names.insert(w.trim_end_matches(',').to_owned());
                    }
                }
            }
            Some(name) => {
                names.insert(name.trim_end_matches('!').to_owned());
            }
            None => {}
        }
    }
}

/// Every `#[idempotent(..)]` function among `items` (and in their modules), as
/// (arguments, the function without the attribute).
fn handlers(items: &[syn::Item], out: &mut Vec<(TokenStream, TokenStream)>) {
    for item in items {
        match item {
            syn::Item::Fn(f) => {
                let mut f = f.clone();
                if let Some(at) = f.attrs.iter().position(|a| {
                    a.path()
                        .segments
                        .last()
                        .is_some_and(|s| s.ident == "idempotent")
                }) {
                    let args = match f.attrs.remove(at).meta {
                        syn::Meta::List(list) => list.tokens,
                        _ => TokenStream::new(),
                    };
                    out.push((args, f.to_token_stream()));
                }
            }
            syn::Item::Mod(m) => {
                if let Some((_, items)) = &m.content {
                    handlers(items, out);
                }
            }
            // gRPC methods, in a service's `impl`.
            syn::Item::Impl(i) => {
                let methods: Vec<syn::Item> = i
                    .items
                    .iter()
                    .filter_map(|item| match item {
                        syn::ImplItem::Fn(m) => Some(syn::Item::Fn(syn::ItemFn {
                            attrs: m.attrs.clone(),
                            vis: m.vis.clone(),
                            modifiers: m.modifiers.clone(),
                            sig: m.sig.clone(),
                            block: Box::new(m.block.clone()),
                        })),
                        _ => None,
                    })
                    .collect();
                handlers(&methods, out);
            }
            _ => {}
        }
    }
}

/// What `private.rs` exports: `pub` items and the leaves of `pub use`.
fn exports(file: &syn::File) -> BTreeSet<String> {
    fn leaves(tree: &syn::UseTree, out: &mut BTreeSet<String>) {
        match tree {
            syn::UseTree::Path(p) => leaves(&p.tree, out),
            syn::UseTree::Name(n) => {
                out.insert(n.ident.to_string());
            }
            syn::UseTree::Rename(r) => {
                out.insert(r.rename.to_string());
            }
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| leaves(t, out)),
            syn::UseTree::Glob(_) => {
                out.insert("*".to_owned());
            }
        }
    }
    let public = |v: &syn::Visibility| matches!(v, syn::Visibility::Public(_));
    let mut out = BTreeSet::new();
    for item in &file.items {
        let name = match item {
            syn::Item::Use(u) if public(&u.vis) => {
                leaves(&u.tree, &mut out);
                continue;
            }
            syn::Item::Fn(i) if public(&i.vis) => &i.sig.ident,
            syn::Item::Struct(i) if public(&i.vis) => &i.ident,
            syn::Item::Enum(i) if public(&i.vis) => &i.ident,
            syn::Item::Trait(i) if public(&i.vis) => &i.ident,
            syn::Item::Mod(i) if public(&i.vis) => &i.ident,
            syn::Item::Const(i) if public(&i.vis) => &i.ident,
            syn::Item::Static(i) if public(&i.vis) => &i.ident,
            syn::Item::Type(i) if public(&i.vis) => &i.ident,
            _ => continue,
        };
        out.insert(name.to_string());
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn private_exports_exactly_what_the_expansions_name() {
    let mut named = BTreeSet::new();
    let mut cases = 0;
    // The failing cases too: their expansions (the error recovery) are emitted.
    let mut ui = Vec::new();
    rust_files(&workspace().join("idem-macros/tests/ui"), &mut ui);
    rust_files(&workspace().join("tests/attribute_shapes"), &mut ui);
    for path in ui {
        let text = std::fs::read_to_string(&path).unwrap();
        let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut found = Vec::new();
        handlers(&file.items, &mut found);
        for (args, item) in found {
            cases += 1;
            named_after_private(
                &crate::expand::idempotent(args, item).to_string(),
                &mut named,
            );
        }
    }
    assert!(
        cases >= 80,
        "only {cases} handlers in the trybuild cases and the shapes"
    );
    // The runtime's own macros, which the expansions call.
    let mut runtime = Vec::new();
    rust_files(&workspace().join("idem-runtime/src"), &mut runtime);
    for path in runtime {
        let text = std::fs::read_to_string(&path).unwrap();
        for rest in text.split("$crate::__private::").skip(1) {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            named.insert(name);
        }
    }
    let private = std::fs::read_to_string(workspace().join("idem-runtime/src/private.rs")).unwrap();
    let exported = exports(&syn::parse_file(&private).unwrap());
    for name in REACHED_THROUGH_SIGNATURES {
        assert!(
            exported.contains(*name),
            "`{name}` is listed as reached but not exported"
        );
        assert!(
            !named.contains(*name),
            "`{name}` is named by an expansion: take it off the list"
        );
    }
    let unused: Vec<_> = exported
        .iter()
        .filter(|e| !named.contains(*e) && !REACHED_THROUGH_SIGNATURES.contains(&e.as_str()))
        .collect();
    assert!(
        unused.is_empty(),
        "`__private` exports what no expansion names: {unused:?} (tests reach their hooks through the `test-util` feature)"
    );
    let missing: Vec<_> = named.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "expansions name what `__private` does not export: {missing:?}"
    );
}
