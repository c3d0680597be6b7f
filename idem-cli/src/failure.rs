//! Why a command failed, each kind with its documented exit code, and how the
//! database's and the store's errors map onto those kinds.

use idem_runtime::StoreError;

/// Why a command failed; each kind has its documented exit code.
#[derive(Debug)]
pub(crate) enum Failure {
    Other(String),
    Usage(String),
    NotFound(String),
    Refused(String),
    /// A refusal after part of the work was done, with the report of what
    /// was (`--json`'s document), printed on stdout all the same: a script
    /// gets the counts, and exit 4 says not everything was done.
    RefusedAfter {
        message: String,
        report: String,
    },
    Database(String),
    NotMigrated,
}

impl Failure {
    pub(crate) fn code(&self) -> u8 {
        match self {
            Failure::Other(_) => 1,
            Failure::Usage(_) => 2,
            Failure::NotFound(_) => 3,
            Failure::Refused(_) | Failure::RefusedAfter { .. } => 4,
            Failure::Database(_) => 5,
            Failure::NotMigrated => 6,
        }
    }

    /// What goes on stdout before the error, if anything.
    pub(crate) fn report(&self) -> Option<&str> {
        match self {
            Failure::RefusedAfter { report, .. } => Some(report),
            _ => None,
        }
    }

    /// A refusal (exit 4) that, with `--json`, still prints `report` (what
    /// was done) on stdout.
    pub(crate) fn refused_after(
        message: String,
        json: bool,
        report: impl FnOnce() -> Result<String, Failure>,
    ) -> Failure {
        if !json {
            return Failure::Refused(message);
        }
        match report() {
            Ok(report) => Failure::RefusedAfter { message, report },
            // The refusal is what matters: its line and exit 4, without the
            // report.
            Err(_) => Failure::Refused(message),
        }
    }

    pub(crate) fn message(&self) -> String {
        match self {
            Failure::Other(m)
            | Failure::Usage(m)
            | Failure::NotFound(m)
            | Failure::Refused(m)
            | Failure::RefusedAfter { message: m, .. }
            | Failure::Database(m) => m.clone(),
            Failure::NotMigrated => {
                "the table idempotency_requests does not exist in this database; \
                 run `idem migrate` first"
                    .to_owned()
            }
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        if is_undefined_table(&e) {
            return Failure::NotMigrated;
        }
        match e {
            sqlx::Error::Io(io) => Failure::Database(format!("cannot reach the database: {io}")),
            // The message alone: Display adds the server's source line, noise here.
            sqlx::Error::Database(db) => Failure::Database(match db.code() {
                Some(code) if is_sqlite(&*db) => {
                    format!("the database said: {} (SQLite code {code})", db.message())
                }
                Some(code) => format!("the database said: {} (SQLSTATE {code})", db.message()),
                None => format!("the database said: {}", db.message()),
            }),
            sqlx::Error::PoolTimedOut => {
                Failure::Database("timed out waiting for a database connection".to_owned())
            }
            // The database answered; what it holds is not what idem wrote (a
            // value of another type in a SQLite column, say): a stored row the
            // CLI cannot read, not a database error. The column's name, never
            // its value.
            sqlx::Error::ColumnDecode { index, .. } => Failure::Other(format!(
                "a stored row the CLI cannot read: column {index} holds a value of another type"
            )),
            sqlx::Error::Decode(_) => Failure::Other("a stored row the CLI cannot read".to_owned()),
            other => Failure::Database(format!("database error: {other}")),
        }
    }
}

/// A table that does not exist: the schema was never migrated in this database.
/// PostgreSQL says `undefined_table`; SQLite has only its generic error code, and
/// says so in the message.
fn is_undefined_table(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    if is_sqlite(&**db) {
        db.message().starts_with("no such table")
    } else {
        // PostgreSQL's undefined_table, MySQL's ER_NO_SUCH_TABLE.
        matches!(db.code().as_deref(), Some("42P01" | "42S02"))
    }
}

/// Whether the error came from SQLite (whose codes are not SQLSTATEs).
#[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
fn is_sqlite(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "sqlite")]
    return db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some();
    #[cfg(not(feature = "sqlite"))]
    return false;
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Database(e) => e.into(),
            StoreError::Migrate(sqlx::migrate::MigrateError::Execute(e)) => e.into(),
            StoreError::Migrate(e) => Failure::Database(format!("migration failed: {e}")),
            StoreError::Corrupt(m) => Failure::Other(format!("a stored row is corrupt: {m}")),
            other => Failure::Database(other.to_string()),
        }
    }
}
