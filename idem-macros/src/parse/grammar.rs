//! The grammar: each option of `#[idempotent(...)]` and of `fingerprint(...)`,
//! declared once, with the type its value is read into.
//!
//! darling's derive reads a list of options into the struct; the value types
//! (`values`) read one option each, and word what they refuse. The declaration
//! also gives the options' names and an example value each, for the messages
//! that list them (an unknown option, a bare value): darling's derive keeps its
//! field names to itself.

use darling::FromMeta;

use super::values::{Fingerprint, Flag, Optional, Text};

/// A list of options: the struct darling reads it into, and what the messages
/// about it say.
pub trait Grammar: FromMeta + Default {
    /// Where the list is written, as the messages name it.
    const PLACE: &'static str;
    /// Each option's name as written and an example value (none for a flag),
    /// in the order the messages list them: the declaration's.
    const OPTIONS: &'static [(&'static str, Option<&'static str>)];

    /// What a bare value `lit` in the list is told to become.
    fn bare_value(lit: &str) -> String;

    /// Whether `name` is one of the options.
    fn knows(name: &str) -> bool {
        Self::OPTIONS.iter().any(|(n, _)| *n == name)
    }
}

/// Declares a list of options once: the struct, with darling's derive, and its
/// [`Grammar`] (the names, renamed where the field cannot be spelled as the
/// option is, and the examples).
macro_rules! grammar {
    (
        $(#[$attr:meta])*
        pub struct $name:ident in $place:literal, bare value: $bare:literal {
            $(
                $(#[$field_attr:meta])*
                $field:ident $(as $rename:literal)? : $ty:ty $(= $example:literal)?,
            )*
        }
    ) => {
        $(#[$attr])*
        #[derive(Debug, Default, FromMeta)]
        pub struct $name {
            $(
                $(#[$field_attr])*
                $(#[darling(rename = $rename)])?
                pub $field: $ty,
            )*
        }

        impl Grammar for $name {
            const PLACE: &'static str = $place;
            const OPTIONS: &'static [(&'static str, Option<&'static str>)] = &[
                $((grammar!(@name $field $($rename)?), grammar!(@example $($example)?))),*
            ];

            fn bare_value(lit: &str) -> String {
                format!($bare, lit)
            }
        }
    };
    (@name $field:ident $rename:literal) => { $rename };
    (@name $field:ident) => { stringify!($field) };
    (@example $example:literal) => { Some($example) };
    (@example) => { None };
}

grammar! {
    /// The options of `#[idempotent(...)]`, as written (the attribute's
    /// reference is in lib.rs; validate checks the values).
    pub struct RawArgs in "`#[idempotent(...)]`",
        bare value: "options are written `name = \"value\"`: write e.g. `operation = {}`"
    {
        operation: Optional<Text> = "\"create-order\"",
        retention: Optional<Text> = "\"24h\"",
        fingerprint: Optional<Fingerprint> = "(body, header = \"x-currency\")",
        single_tenant: Flag,
        in_flight_wait: Optional<Text> = "\"500ms\"",
        lease: Optional<Text> = "\"30s\"",
        lease_ceiling: Optional<Text> = "\"5m\"",
        accepted: Flag,
        key: Optional<Text> = "\"metadata\"",
        krate as "crate": Optional<Text> = "\"::idem_runtime\"",
    }
}

grammar! {
    /// The options of `fingerprint(...)` that darling reads; the `body.field`
    /// paths beside them are not meta syntax, and [`Fingerprint`] reads them
    /// with syn.
    pub struct FingerprintArgs in "`fingerprint(...)`",
        bare value: "write `header = {}` for a header, or `body`"
    {
        body: Flag,
        #[darling(multiple)]
        header: Vec<Text> = "\"x-currency\"",
        ignore_body: Flag,
    }
}

/// The example value of the option `name`, in either list.
pub fn example(name: &str) -> &'static str {
    RawArgs::OPTIONS
        .iter()
        .chain(FingerprintArgs::OPTIONS)
        .find(|(n, _)| *n == name)
        .and_then(|(_, e)| *e)
        .unwrap_or("\"...\"")
}
