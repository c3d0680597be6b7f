//! `sqlx::migrate!` embeds `migrations/` at compile time; a new migration file
//! must rebuild the crate even when no Rust source changed.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
