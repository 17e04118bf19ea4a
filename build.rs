//! Records the commit the binary was built from, for `edgeinfer_build_info`,
//! and the config structs' fields for the config reference.

fn main() {
    let sha = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BUILD_GIT_SHA={sha}");
    // `doctor` calls a clock behind the commit's time wrong (TLS would fail).
    let time = git(&["log", "-1", "--format=%ct"]).unwrap_or_else(|| "0".into());
    println!("cargo:rustc-env=BUILD_COMMIT_TIME={time}");
    // The triple the binary was compiled for (musl or gnu, arm64 or x86-64).
    println!("cargo:rustc-env=BUILD_TARGET={}", std::env::var("TARGET").unwrap_or_default());
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    write_config_docs();
}

/// What `git ARGS` prints, trimmed; None outside a checkout or without git.
fn git(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The config reference's raw material (`edgeinfer config reference`,
/// docs/CONFIG.md): every config struct's fields with their types and doc
/// comments, and the words each config enum takes, read from the source
/// so the reference cannot drift from the code. The binary formats it.
fn write_config_docs() {
    const SOURCES: [&str; 3] = ["src/config.rs", "src/config/rollout.rs", "src/protocol/types.rs"];
    let mut structs = String::new();
    let mut enums = String::new();
    for path in SOURCES {
        println!("cargo:rerun-if-changed={path}");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
        for item in file.items {
            match item {
                // The protocol's structs are the wire's, not the config's.
                syn::Item::Struct(s) if derives_deserialize(&s.attrs) && path.starts_with("src/config") => {
                    let syn::Fields::Named(fields) = s.fields else { continue };
                    structs.push_str(&format!("    ({:?}, &[\n", s.ident.to_string()));
                    for field in fields.named {
                        let ty = quote::ToTokens::to_token_stream(&field.ty).to_string().replace(' ', "");
                        let name = field.ident.expect("named field").to_string();
                        structs.push_str(&format!("        ({name:?}, {ty:?}, {:?}),\n", doc(&field.attrs)));
                    }
                    structs.push_str("    ]),\n");
                }
                syn::Item::Enum(e) if derives_deserialize(&e.attrs) => {
                    let words: Vec<String> =
                        e.variants.iter().map(|v| snake_case(&v.ident.to_string())).collect();
                    enums.push_str(&format!("    ({:?}, &{words:?}),\n", e.ident.to_string()));
                }
                _ => {}
            }
        }
    }
    let out = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("config_docs.rs");
    let code = format!(
        "/// (field, type, doc comment)\n\
         pub type Field = (&'static str, &'static str, &'static str);\n\
         /// (struct, its fields) for every config struct.\n\
         pub static STRUCTS: &[(&str, &[Field])] = &[\n{structs}];\n\
         /// (enum, the words it takes) for every config enum.\n\
         pub static ENUMS: &[(&str, &[&str])] = &[\n{enums}];\n"
    );
    std::fs::write(out, code).unwrap();
}

fn derives_deserialize(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("derive") && quote::ToTokens::to_token_stream(a).to_string().contains("Deserialize")
    })
}

/// The doc comment's lines joined into one paragraph.
fn doc(attrs: &[syn::Attribute]) -> String {
    let lines = attrs.iter().filter_map(|a| match &a.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("doc") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value().trim().to_string()),
            _ => None,
        },
        _ => None,
    });
    lines.collect::<Vec<_>>().join(" ")
}

fn snake_case(ident: &str) -> String {
    let mut out = String::new();
    for (i, c) in ident.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}
