//! [`Idem`]: the pool and the settings that every idempotent handler shares.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderName;
use sqlx::Pool;

use crate::db::Backend;
use crate::lease::LeaseBackend;
use crate::running::RunningLimit;

/// Response headers stored and replayed unless configured otherwise.
pub const DEFAULT_STORED_HEADERS: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
];

/// Headers that are never stored, whatever the configuration says: replaying them
/// would hand one response's session or credentials to another request.
pub const NEVER_STORED_HEADERS: &[&str] = &["set-cookie", "set-cookie2"];

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The header may not be stored (see [`NEVER_STORED_HEADERS`]).
    #[error("the response header `{0}` must never be stored or replayed")]
    ForbiddenHeader(String),
    /// Not a valid header name.
    #[error("`{0}` is not a valid HTTP header name")]
    InvalidHeader(String),
    /// Not a path the operation resources can live under (see
    /// [`Idem::with_operations_path`]).
    #[error(
        "`{0}` cannot hold operation resources: give an absolute path such as \"/operations\", of ASCII letters, digits and `/-._~!$&'()+,;=:@%` (percent-encode the rest; no segment starting with `:`), without a trailing `/`, a query or a fragment"
    )]
    InvalidOperationsPath(String),
    /// A running limit that lets nothing run (see [`Idem::with_running_limit`]).
    #[error(
        "the running limit of `{operation}` lets nothing run ({what} of 0): give at least 1, or set no limit"
    )]
    ZeroRunningLimit {
        /// The operation the limit was for.
        operation: String,
        /// `a total` or `a tenant's share`.
        what: &'static str,
    },
}

/// What idem needs at run time: the pool (PostgreSQL, SQLite as `Idem<Sqlite>`,
/// or MySQL / MariaDB as `Idem<MySql>`) and its settings.
///
/// Cheap to clone. Put it in your router state and expose it with
/// [`axum::extract::FromRef`], so that `#[idempotent]` handlers can find it:
///
/// ```no_run
/// # #[cfg(feature = "postgres")] // the example's database is PostgreSQL
/// # mod doc {
/// use sqlx::Postgres;
/// use axum::extract::FromRef;
/// use idem_runtime::Idem;
///
/// #[derive(Clone)]
/// struct AppState {
///     idem: Idem<Postgres>,
/// }
///
/// impl FromRef<AppState> for Idem<Postgres> {
///     fn from_ref(state: &AppState) -> Idem<Postgres> {
///         state.idem.clone()
///     }
/// }
///
/// # async fn demo(pool: sqlx::PgPool) {
/// let idem = Idem::new(pool).with_in_flight_wait(std::time::Duration::from_millis(500));
/// let state = AppState { idem };
/// # }
/// # }
/// ```
///
/// The type names its database, as sqlx's do: `Idem<Postgres>` from a `PgPool`; a
/// service on SQLite uses `Idem<Sqlite>` built from a `SqlitePool`, and its handlers take
/// `&mut Tx<Sqlite>`; on MySQL or MariaDB, `Idem<MySql>` from a `MySqlPool`, and
/// `&mut Tx<MySql>`.
///
/// With the feature `redis`, `Idem<idem_runtime::redis::Redis>` (built by
/// `RedisLeaseStore::idem`) runs leased handlers on Redis.
pub struct Idem<DB: LeaseBackend> {
    pool: DB::Store,
    settings: Arc<Settings>,
    /// See [`Idem::with_claims_at_commit`].
    claims_at_commit: bool,
    /// Shared by clones: duplicates of a key wait for its first request here,
    /// without a connection.
    flights: Arc<crate::flight::Flights>,
    /// Shared by clones: the executions running now.
    executions: crate::executions::Executions,
    /// Shared by clones: the renewals of this store's leases, batched.
    renewals: crate::lease::Renewals<DB>,
    /// Shared by clones: whether this pool's claims use statements prepared in
    /// the session, once decided (PostgreSQL; see
    /// [`Idem::with_session_statements`]), so that a request does not look the
    /// choice up again.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    session_path: Arc<std::sync::OnceLock<bool>>,
    /// Shared by clones: keys seen finished lately, whose retries read the key
    /// first (PostgreSQL's session path; see [`Idem::with_replay_hints`]).
    #[cfg(feature = "postgres")]
    recent: Option<Arc<crate::recent::Recent>>,
}

impl<DB: LeaseBackend> Clone for Idem<DB> {
    fn clone(&self) -> Self {
        Idem {
            pool: self.pool.clone(),
            settings: self.settings.clone(),
            claims_at_commit: self.claims_at_commit,
            flights: self.flights.clone(),
            executions: self.executions.clone(),
            renewals: self.renewals.clone(),
            session_path: self.session_path.clone(),
            #[cfg(feature = "postgres")]
            recent: self.recent.clone(),
        }
    }
}

impl<DB: LeaseBackend> std::fmt::Debug for Idem<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idem")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct Settings {
    in_flight_wait: Duration,
    request_deadline: Duration,
    max_response_bytes: usize,
    stored_headers: Vec<HeaderName>,
    tenant_label: bool,
    /// Where the operation resources of long operations live (`Location`).
    operations_path: String,
    /// See [`Idem::with_session_statements`].
    session_statements: Option<bool>,
    /// See [`Idem::with_checkout_test`].
    checkout_test: bool,
    #[cfg(feature = "replay-cache")]
    replay_cache: Option<crate::ReplayCache>,
    /// See [`Idem::with_running_limit`].
    running: crate::running::RunningLimits,
    /// See [`Idem::with_key_ring`].
    key_ring: Option<crate::at_rest::KeyRing>,
}

impl<DB: Backend> Idem<DB> {
    /// Uses `pool` with the default settings.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::on_store(pool)
    }

    /// The pool claims run on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// A [`crate::reconcile::Reconciler`] on this service's pool that seals
    /// the outcomes it resolves with this service's key ring, if it has one
    /// ([`Idem::with_key_ring`]): the outcomes a reconciler stores are the
    /// uncertain effects, a payment's above all, and one built with
    /// `Reconciler::new(pool, ..)` stores them in clear unless it is given the
    /// ring too (and a service whose ring refuses clear answers then answers
    /// them `503`).
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(idem: idem_runtime::Idem<sqlx::Postgres>, provider: impl idem_runtime::reconcile::Reconcile) {
    /// idem.reconciler(provider).spawn();
    /// # }
    /// ```
    pub fn reconciler<R: crate::reconcile::Reconcile>(
        &self,
        reconcile: R,
    ) -> crate::reconcile::Reconciler<R, DB>
    where
        DB: LeaseBackend,
    {
        let reconciler = crate::reconcile::Reconciler::new(self.pool.clone(), reconcile);
        match self.key_ring() {
            Some(ring) => reconciler.with_key_ring(ring.clone()),
            None => reconciler,
        }
    }

    /// Applies idem's migrations to the pool's database (see [`crate::migrate`]).
    ///
    /// # Errors
    ///
    /// As [`crate::migrate`].
    pub async fn migrate(&self) -> Result<(), crate::StoreError> {
        crate::store::migrate(&self.pool).await
    }

    /// Erases every row of `tenant` that no execution in flight needs, in
    /// batches of [`crate::admin::ERASE_BATCH`], and clears this process's
    /// replay cache (see [`crate::admin::erase_tenant`], which also says what is
    /// left and why).
    ///
    /// # Errors
    ///
    /// As [`crate::admin::erase_tenant`].
    pub async fn erase_tenant(
        &self,
        tenant: &str,
    ) -> Result<crate::admin::TenantErasure, crate::StoreError> {
        // Whatever the erasure got to, no answer of the tenant's stays in
        // memory: cleared when it ends, fails, or is dropped part-way (a
        // request timeout), its deleted batches committed.
        #[cfg(feature = "replay-cache")]
        let _clear = ClearOnDrop(self.replay_cache());
        crate::admin::erase_tenant(
            &self.pool,
            tenant,
            crate::admin::ERASE_BATCH,
            crate::admin::InFlightRows::Keep,
        )
        .await
    }

    /// PostgreSQL and MySQL / MariaDB: whether a handler's key is claimed by the
    /// row its completion inserts (on by default), rather than by a row written
    /// before the handler runs and updated at completion.
    ///
    /// On, a first execution writes idem's row once and adds two prepared
    /// statements to the handler's transaction: a lookup before it (which also
    /// answers every retry of a finished key, with no transaction) and the insert
    /// before its `COMMIT`. A duplicate on another process that arrives while the
    /// first is still running its handler runs its own handler too; its
    /// transaction then waits for the first's, rolls back, and answers the first's
    /// stored outcome, so exactly one effect commits.
    ///
    /// Off, the key is claimed before the handler runs (`idem_claim`, as
    /// hand-written [`crate::claim`] calls do) and such a duplicate waits, up to
    /// the in-flight wait, before it runs anything: for handlers whose work must
    /// not even start twice (say, a long computation), at the price of a second
    /// write of the row. PostgreSQL and MySQL / MariaDB claim at commit; no effect
    /// on SQLite, whose handler path holds the database's write lock from the
    /// lookup on (no duplicate runs beside the first there), and none on
    /// hand-written [`crate::claim`] calls.
    pub fn with_claims_at_commit(mut self, on: bool) -> Self {
        self.claims_at_commit = on;
        self
    }

    /// PostgreSQL: whether a first execution's lookup rides with `BEGIN` and its
    /// finished row with `COMMIT`, through three statements idem prepares in each
    /// server session (SQL `PREPARE`), so that it costs the round trips of the
    /// handler's own transaction and no more. By default idem decides per
    /// database target with the pooler probe that `migrate` and
    /// `check_pooler` run (or the first claim, if neither
    /// ran): on where each connection keeps its server session (no pooler, or
    /// session pooling), off where a pooler runs each transaction on whichever
    /// server is free (those keep only protocol-level prepared statements), and
    /// logs the choice once. Off, each of idem's statements is sent with bound
    /// parameters, a round trip each. No effect with claims at commit off
    /// ([`Idem::with_claims_at_commit`]), nor on SQLite and MySQL.
    ///
    /// Force it off where sessions are reset between checkouts by something the
    /// probe cannot see (a pooler's `server_reset_query` run per transaction, a
    /// `DISCARD ALL` of your own); a statement found missing is prepared again,
    /// at the cost of a round trip.
    pub fn with_session_statements(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.settings).session_statements = Some(on);
        self
    }

    /// PostgreSQL's session path: whether this `Idem` (and its clones) remembers
    /// the keys it has seen finished lately (committed here, or replayed), so
    /// that a retry of one reads the key first, one
    /// message and no transaction, instead of beginning with the probe that
    /// fails for a key with a row (an aborted transaction, an `ERROR` in the
    /// server's log, and a second message). On by default.
    ///
    /// A hint only: the table holds 16,384 64-bit tags (128 KiB, allocated at the
    /// first key recorded) and forgets, and the database decides every answer
    /// as without it. A remembered key whose row has expired, or was swept or
    /// purged since, costs the read before its claim, which then begins as
    /// without the hint (below). Retries that reach
    /// another process (another replica) take the probe as before. No effect on
    /// SQLite and MySQL, nor where the session path is off (that path always
    /// looks the key up first).
    ///
    /// The read takes an idle connection as it is (`Pool::try_acquire`, without
    /// the pool's acquire ping or `before_acquire` hook), so that a replay waits
    /// for one round trip rather than two; where none is idle, or the
    /// connection turns out lost (a connection the server dropped: what the
    /// ping is there to find), the key is read on a connection from
    /// `acquire()`, tested as the pool says. Only an answer is decided on the
    /// untested connection: a key that executes again begins its claim on a
    /// tested one, with the probe. With hints on, a retry that does begin with
    /// the probe (its key not remembered: another replica answered it) is read
    /// on an idle connection taken the same way, so that it does not wait for
    /// the driver's `ROLLBACK` of the failed probe. Turn hints off where your
    /// `before_acquire` must see every checkout.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let idem = idem_runtime::Idem::new(pool).with_replay_hints(false);
    /// # }
    /// ```
    #[cfg_attr(not(feature = "postgres"), allow(unused_mut))]
    pub fn with_replay_hints(mut self, on: bool) -> Self {
        // Turning hints on keeps the table clones made earlier share.
        #[cfg(feature = "postgres")]
        if !on {
            self.recent = None;
        } else if self.recent.is_none() {
            self.recent = Some(Default::default());
        }
        #[cfg(not(feature = "postgres"))]
        let _ = on;
        self
    }

    /// Replay hints on, and nothing remembered (`test_util::as_another_replica`).
    #[cfg(all(feature = "postgres", feature = "test-util"))]
    pub(crate) fn with_forgetful_hints(mut self) -> Self {
        self.recent = Some(Arc::new(crate::recent::Recent::forgetful()));
        self
    }

    /// PostgreSQL's session path: whether a first execution's connection comes
    /// from `Pool::acquire`, which tests it (the acquire ping, where the pool's
    /// `test_before_acquire` is on, as it is by default) and runs the pool's
    /// `before_acquire` hook. On by default.
    ///
    /// Off, a first execution takes an idle connection as it is
    /// (`Pool::try_acquire`) and its first message is the test: `BEGIN` with
    /// the probe, which reads the key and changes nothing, so where it finds
    /// the connection lost (dropped by the server, a pooler or a network in
    /// between: what the ping is there to find) the claim begins again on a
    /// connection from `acquire()`, and nothing ran twice. That saves the
    /// ping's round trip on the request's path: with the ping, a first
    /// execution waits for the bare write's four round trips, without it for
    /// three (at 1 ms a round trip, about a millisecond a request). Where no
    /// connection is idle, the claim waits in `acquire()` as it would have.
    ///
    /// Leave it on where your `before_acquire` must see every connection a
    /// handler's transaction runs on (one that sets per-checkout session
    /// state, or refuses connections by its own test): off, a first execution's
    /// transaction may run on a connection that hook did not see. To save the
    /// ping and keep the hook, turn the ping off in the pool instead
    /// (`PgPoolOptions::test_before_acquire(false)`): `acquire()` then runs
    /// `before_acquire` alone, and on the session path idem takes the claim's
    /// first message (or a remembered key's read) as the connection's test as
    /// above (a dropped connection is closed and the claim begins on another,
    /// up to one more than the pool's size). Your own queries on that pool
    /// then go untested too, and so do idem's on the bound-parameter path: a
    /// dropped connection fails the request there (`503`, nothing stored). A replay of a
    /// key this process remembers is read untested either way (see
    /// [`Idem::with_replay_hints`]). No effect where the session path is off
    /// ([`Idem::with_session_statements`]: each of idem's statements is a round
    /// trip there, and the claim begins on a connection from `acquire()`), nor on
    /// SQLite and MySQL.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(pool: sqlx::PgPool) {
    /// // The pool has no `before_acquire` hook: the claim's first message tests
    /// // the connection, one round trip fewer per first execution.
    /// let idem = idem_runtime::Idem::new(pool).with_checkout_test(false);
    /// # }
    /// ```
    pub fn with_checkout_test(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.settings).checkout_test = on;
        self
    }

    /// The earlier name of [`Idem::with_claims_at_commit`]: the claim no longer
    /// travels with `BEGIN` (nor as SQL text), but it still adds no statement of
    /// its own.
    #[deprecated(since = "0.2.0", note = "use `Idem::with_claims_at_commit`")]
    pub fn with_pipelined_claims(self, on: bool) -> Self {
        self.with_claims_at_commit(on)
    }

    /// The longest a transactional request may take from its claim to its
    /// commit, handler included (default [`Idem::DEFAULT_REQUEST_DEADLINE`]; never
    /// less than the in-flight wait plus a second).
    ///
    /// Past it the request is abandoned: the client gets `503` with
    /// `Retry-After`, the transaction is rolled back and its connection closed,
    /// and the key is free for the retry. So a stalled database (a cut or
    /// blackholed connection, a lock held elsewhere) or a stuck handler costs a
    /// bounded wait, not a hung request. On PostgreSQL the transaction also
    /// carries what is left of it when it begins, a second longer (the client
    /// abandons first), as `statement_timeout` and
    /// `idle_in_transaction_session_timeout`, so the server frees the key even
    /// when it never hears from the client again.
    /// Leased handlers are not cut short (their lease bounds them).
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let idem = idem_runtime::Idem::new(pool)
    ///     .with_request_deadline(std::time::Duration::from_secs(10));
    /// # }
    /// ```
    pub fn with_request_deadline(mut self, deadline: Duration) -> Self {
        Arc::make_mut(&mut self.settings).request_deadline = deadline;
        self
    }

    /// The request deadline (see [`Idem::with_request_deadline`]).
    pub fn request_deadline(&self) -> Duration {
        self.settings.request_deadline
    }

    /// The deadline a request with `in_flight_wait` gets: never less than that
    /// wait plus a second, so that a duplicate's wait ends before its request
    /// is abandoned.
    pub(crate) fn deadline_with_wait(&self, in_flight_wait: Duration) -> Duration {
        self.request_deadline()
            .max(in_flight_wait.saturating_add(Duration::from_secs(1)))
    }

    /// What a claim on the handler's path needs of this `Idem` (see
    /// `db::ClaimContext`), for a request whose in-flight wait is
    /// `in_flight_wait`.
    pub(crate) fn claim_context(&self, in_flight_wait: Duration) -> crate::db::ClaimContext<'_, DB>
    where
        DB: crate::db::Backend,
    {
        crate::db::ClaimContext {
            pool: self.pool(),
            claims_at_commit: self.claims_at_commit,
            deadline: self.deadline_with_wait(in_flight_wait),
            ends_at: None,
            session_statements: self.settings.session_statements,
            checkout_test: self.settings.checkout_test,
            session_path: &self.session_path,
            #[cfg(feature = "postgres")]
            recent: self.recent.as_deref(),
        }
    }

    /// Whether a first execution's connection is tested by the pool (see
    /// [`Idem::with_checkout_test`]).
    pub fn checkout_test(&self) -> bool {
        self.settings.checkout_test
    }

    /// Whether keys are claimed at commit (see [`Idem::with_claims_at_commit`]).
    pub fn claims_at_commit(&self) -> bool {
        self.claims_at_commit
    }

    /// The earlier name of [`Idem::claims_at_commit`].
    #[deprecated(since = "0.2.0", note = "use `Idem::claims_at_commit`")]
    pub fn pipelined_claims(&self) -> bool {
        self.claims_at_commit()
    }

    /// How long a duplicate request waits for a concurrent first request with the
    /// same key to finish before it is answered `409 Conflict` with `Retry-After`.
    /// A request waiting in the database holds a pool connection (one waiting in
    /// the same process does not, see [`Idem::with_waiter_limits`]). A handler's
    /// `in_flight_wait = "..."` overrides it. A wait longer than the databases'
    /// lock timeouts can hold (`i32::MAX` milliseconds, about 24.8 days) is that.
    pub fn with_in_flight_wait(mut self, wait: Duration) -> Self {
        let longest = Duration::from_millis(i32::MAX as u64);
        Arc::make_mut(&mut self.settings).in_flight_wait = wait.min(longest);
        self
    }

    /// The configured in-flight wait.
    pub fn in_flight_wait(&self) -> Duration {
        self.settings.in_flight_wait
    }
}

impl<DB: LeaseBackend> Idem<DB> {
    /// The in-flight wait as configured, for the pipeline both modes share.
    pub(crate) fn configured_in_flight_wait(&self) -> Duration {
        self.settings.in_flight_wait
    }

    /// The default in-flight wait: how long a duplicate waits for the first request.
    pub const DEFAULT_IN_FLIGHT_WAIT: Duration = Duration::from_secs(2);
    /// The default request deadline (see [`Idem::with_request_deadline`]).
    pub const DEFAULT_REQUEST_DEADLINE: Duration = Duration::from_secs(30);
    /// The default bound on the duplicates of one key that wait in this process
    /// for its first request (see [`Idem::with_waiter_limits`]).
    pub const DEFAULT_WAITERS_PER_KEY: usize = 32;
    /// The default bound on all the duplicates that wait in this process.
    pub const DEFAULT_WAITERS: usize = 1024;
    /// The default limit on a stored response body.
    pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;
    /// Where operation resources live unless configured otherwise (see
    /// [`Idem::with_operations_path`]).
    pub const DEFAULT_OPERATIONS_PATH: &'static str = "/operations";

    /// Uses `store` (a pool, or a Redis store) with the default settings.
    pub(crate) fn on_store(pool: DB::Store) -> Self {
        Idem {
            renewals: crate::lease::Renewals::new(pool.clone()),
            pool,
            settings: Arc::new(Settings {
                in_flight_wait: Self::DEFAULT_IN_FLIGHT_WAIT,
                request_deadline: Self::DEFAULT_REQUEST_DEADLINE,
                max_response_bytes: Self::DEFAULT_MAX_RESPONSE_BYTES,
                stored_headers: DEFAULT_STORED_HEADERS
                    .iter()
                    .map(|h| HeaderName::from_static(h))
                    .collect(),
                tenant_label: false,
                operations_path: Self::DEFAULT_OPERATIONS_PATH.to_owned(),
                session_statements: None,
                checkout_test: true,
                #[cfg(feature = "replay-cache")]
                replay_cache: None,
                running: Default::default(),
                key_ring: None,
            }),
            claims_at_commit: true,
            flights: Arc::new(crate::flight::Flights::new(
                Self::DEFAULT_WAITERS_PER_KEY,
                Self::DEFAULT_WAITERS,
            )),
            executions: Default::default(),
            session_path: Default::default(),
            #[cfg(feature = "postgres")]
            recent: Some(Default::default()),
        }
    }

    /// Bounds the duplicates that wait in this process for their key's first
    /// request: at most `per_key` for one key and `total` for all keys (defaults
    /// [`Idem::DEFAULT_WAITERS_PER_KEY`] and [`Idem::DEFAULT_WAITERS`]).
    ///
    /// A duplicate of a key whose first request is still running in this process
    /// waits for it without holding a database connection, up to the in-flight
    /// wait, then claims (and usually replays the committed outcome); so a burst
    /// of retries of one slow key does not take the pool from everyone else. Past
    /// a bound it is answered `409` with `Retry-After` at once. Duplicates in
    /// other processes wait in the database as before. Applies to the
    /// transactional mode (a leased claim commits at once and never waits).
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let idem = idem_runtime::Idem::new(pool).with_waiter_limits(8, 256);
    /// assert_eq!(idem.waiting_duplicates(), 0);
    /// # }
    /// ```
    pub fn with_waiter_limits(mut self, per_key: usize, total: usize) -> Self {
        self.flights = Arc::new(crate::flight::Flights::new(per_key, total));
        self
    }

    /// The duplicates waiting in this process for their key's first request now
    /// (see [`Idem::with_waiter_limits`]).
    pub fn waiting_duplicates(&self) -> usize {
        self.flights.waiting()
    }

    /// The executions of this `Idem` and its clones that run now, for a graceful
    /// shutdown: [`crate::Executions::drained`] waits for them (see there).
    pub fn executions(&self) -> crate::Executions {
        self.executions.clone()
    }

    /// Counts this `Idem`'s executions together with `other`'s, so that one
    /// graceful shutdown waits for both (a service whose leased handlers run on
    /// Redis and the others on a pool).
    pub fn sharing_executions_with<B: LeaseBackend>(mut self, other: &Idem<B>) -> Self {
        self.executions = other.executions.clone();
        self
    }

    /// The renewals of this `Idem`'s leased executions (and its clones').
    pub(crate) fn renewals(&self) -> &crate::lease::Renewals<DB> {
        &self.renewals
    }

    /// The batch statements that renewed this `Idem`'s leases so far, and the
    /// lease renewals they carried (for tests and the bench).
    #[doc(hidden)]
    pub fn renewal_statements(&self) -> (u64, u64) {
        self.renewals.sent()
    }

    /// How many leased executions of this `Idem` (and its clones') are being
    /// renewed now (for tests).
    #[doc(hidden)]
    pub fn renewing_leases(&self) -> usize {
        self.renewals.registered()
    }

    /// The waiting room of this `Idem` and its clones.
    pub(crate) fn flights(&self) -> &Arc<crate::flight::Flights> {
        &self.flights
    }

    /// The largest response body that is stored. A larger body is not stored: in
    /// the transactional mode the transaction is rolled back and the client gets
    /// `500` with the problem type [`crate::problem::RESPONSE_TOO_LARGE`], so
    /// nothing runs without its outcome being recorded; in leased mode the effect
    /// has happened outside, so the row is marked `uncertain` for the reconciler
    /// and the client gets `202`.
    pub fn with_max_response_bytes(mut self, limit: usize) -> Self {
        Arc::make_mut(&mut self.settings).max_response_bytes = limit;
        self
    }

    /// Stores and replays one more response header besides
    /// [`DEFAULT_STORED_HEADERS`].
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for an invalid name or one of [`NEVER_STORED_HEADERS`].
    pub fn with_stored_header(mut self, name: &str) -> Result<Self, ConfigError> {
        let lower = name.to_ascii_lowercase();
        if NEVER_STORED_HEADERS.contains(&lower.as_str()) {
            return Err(ConfigError::ForbiddenHeader(lower));
        }
        let header = HeaderName::from_bytes(lower.as_bytes())
            .map_err(|_| ConfigError::InvalidHeader(lower))?;
        let settings = Arc::make_mut(&mut self.settings);
        if !settings.stored_headers.contains(&header) {
            settings.stored_headers.push(header);
        }
        Ok(self)
    }

    /// Bounds the leased executions of `operation` that run at once in this
    /// process, in all and per tenant (see [`RunningLimit`]).
    ///
    /// A first request of the operation that finds the bound full is answered
    /// `503` problem [`crate::problem::AT_CAPACITY`] with `Retry-After`, and
    /// reserves nothing: the key it claimed is given back, free for the retry
    /// (a key taken over from a lapsed lease is left to lapse again instead, so
    /// that the retry still learns it is a takeover). A retry of a running or
    /// finished key never needs a slot and is answered as always. A slot is
    /// given back when the execution's handler returns, or when its lease is
    /// lost (the key may then be taken over, here too). The running
    /// count is the gauge `idem_running_executions`, beside
    /// `idem_running_limit`. The transactional mode is bounded by its pool.
    ///
    /// A setting of the service, not of the attribute: how much may run at once
    /// depends on where the service runs (its cores, its downstream's quota),
    /// not on what the operation is (docs/decisions.md, "Running limits").
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroRunningLimit`] for a total or a share of 0.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::ConfigError> {
    /// use idem_runtime::{Idem, RunningLimit};
    ///
    /// let idem: Idem<sqlx::Postgres> =
    ///     Idem::new(pool).with_running_limit("export", RunningLimit::new(200).per_tenant(20))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_running_limit(
        mut self,
        operation: &str,
        limit: RunningLimit,
    ) -> Result<Self, ConfigError> {
        for (value, what) in [
            (limit.total(), "a total"),
            (limit.tenant_share(), "a tenant's share"),
        ] {
            if value == 0 {
                return Err(ConfigError::ZeroRunningLimit {
                    operation: operation.to_owned(),
                    what,
                });
            }
        }
        Arc::make_mut(&mut self.settings)
            .running
            .set(operation, limit);
        Ok(self)
    }

    /// The leased executions of `operation` that hold a slot of its running
    /// limit now, if it has one (see [`Idem::with_running_limit`]).
    pub fn running(&self, operation: &str) -> Option<usize> {
        self.settings.running.of(operation).map(|s| s.running())
    }

    /// The operation's slots, if it has a running limit.
    pub(crate) fn running_slots(&self, operation: &str) -> Option<&Arc<crate::running::Slots>> {
        self.settings.running.of(operation)
    }

    /// Adds the tenant as a label to `idem_claims_total`. Off by default: a service
    /// with many tenants would create a time series per tenant.
    pub fn with_tenant_label(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.settings).tenant_label = on;
        self
    }

    /// Seals every answer this `Idem` stores with `ring`'s active key, and opens
    /// sealed answers when a retry replays them (see [`crate::at_rest`]): the
    /// headers and body are encrypted and authenticated, bound to their row;
    /// the status, tenant, operation, key digest and times stay clear. Off by
    /// default. Answers stored in clear before stay readable; an answer sealed
    /// with a key the ring lacks is answered `503` (the key named in the log),
    /// never replayed and never run again. The replay cache, if any, holds
    /// opened answers, in memory only.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::at_rest::KeyRingError> {
    /// use idem_runtime::{Idem, at_rest::KeyRing};
    ///
    /// let mut idem = Idem::new(pool);
    /// if let Some(ring) = KeyRing::from_env()? {
    ///     idem = idem.with_key_ring(ring);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_key_ring(mut self, ring: crate::at_rest::KeyRing) -> Self {
        Arc::make_mut(&mut self.settings).key_ring = Some(ring);
        self
    }

    /// The key ring answers are sealed with, if one was set.
    pub fn key_ring(&self) -> Option<&crate::at_rest::KeyRing> {
        self.settings.key_ring.as_ref()
    }

    /// Answers retries of outcomes this process completed from `cache`, without
    /// a database round trip (transactional mode; see [`crate::ReplayCache`] for
    /// what it keeps and how a purge elsewhere is seen). Off by default; needs the
    /// `replay-cache` feature.
    #[cfg(feature = "replay-cache")]
    pub fn with_replay_cache(mut self, cache: crate::ReplayCache) -> Self {
        Arc::make_mut(&mut self.settings).replay_cache = Some(cache);
        self
    }

    /// The replay cache, if one was set.
    #[cfg(feature = "replay-cache")]
    pub fn replay_cache(&self) -> Option<&crate::ReplayCache> {
        self.settings.replay_cache.as_ref()
    }

    /// Forgets every answer the replay cache holds (shared by every clone of
    /// this `Idem`), so that the next request of each key asks the database.
    /// Call it when the database may have lost outcomes this process
    /// committed (a failover with asynchronous replication) or moved its clock,
    /// before serving again: the cache would otherwise keep replaying them until
    /// its `max_age`. No effect without a cache.
    ///
    /// ```no_run
    /// use sqlx::Postgres;
    /// # async fn demo(idem: idem_runtime::Idem<Postgres>) {
    /// // after the database failed over
    /// idem.clear_replay_cache();
    /// # }
    /// ```
    #[cfg(feature = "replay-cache")]
    pub fn clear_replay_cache(&self) {
        if let Some(cache) = self.replay_cache() {
            cache.clear();
        }
    }

    /// Where the service mounts [`crate::operations::router`]: the path the
    /// `Location` of a long operation's `202 Accepted` starts with (default
    /// [`Idem::DEFAULT_OPERATIONS_PATH`]). An operation's resource is
    /// `{path}/{operation}/{digest}`; nest the router at the same path.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_runtime::ConfigError> {
    /// let idem = idem_runtime::Idem::new(pool).with_operations_path("/v1/operations")?;
    /// assert_eq!(idem.operations_path(), "/v1/operations");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidOperationsPath`] for anything but an absolute path
    /// without a trailing `/`, a query or a fragment, written in the characters
    /// a URL's path holds as they are (ASCII letters, digits and
    /// `/-._~!$&'()+,;=:@%`; percent-encode the rest).
    pub fn with_operations_path(mut self, path: &str) -> Result<Self, ConfigError> {
        // Written as it is sent: a `Location` holds it byte for byte, so a
        // character a client would percent-encode (any non-ASCII one) would
        // come back as another path; and axum would read `{..}` or `*` in the
        // path the router is nested at as a parameter of its own.
        let usable = path.len() > 1
            && path.starts_with('/')
            && !path.ends_with('/')
            && !path.contains("//")
            && path
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/-._~!$&'()+,;=:@%".contains(&b))
            // axum 0.8 refuses, by a panic at `nest`, a segment in 0.7's
            // parameter syntax.
            && !path.split('/').any(|segment| segment.starts_with(':'))
            && percent_encoded_whole(path)
            && path.parse::<axum::http::uri::PathAndQuery>().is_ok();
        if !usable {
            return Err(ConfigError::InvalidOperationsPath(path.to_owned()));
        }
        Arc::make_mut(&mut self.settings).operations_path = path.to_owned();
        Ok(self)
    }

    /// Where operation resources live (see [`Idem::with_operations_path`]).
    pub fn operations_path(&self) -> &str {
        &self.settings.operations_path
    }

    /// Whether claims are labelled with the tenant.
    pub fn tenant_label(&self) -> bool {
        self.settings.tenant_label
    }

    /// The store leased claims run on (for a pool, the same as [`Idem::pool`]).
    pub(crate) fn lease_store(&self) -> &DB::Store {
        &self.pool
    }

    /// The configured response body limit.
    pub fn max_response_bytes(&self) -> usize {
        self.settings.max_response_bytes
    }

    /// The response headers that are stored and replayed.
    pub fn stored_headers(&self) -> &[HeaderName] {
        &self.settings.stored_headers
    }
}

/// Clears a replay cache when dropped (see [`Idem::erase_tenant`]).
#[cfg(feature = "replay-cache")]
struct ClearOnDrop<'a>(Option<&'a crate::ReplayCache>);

#[cfg(feature = "replay-cache")]
impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(cache) = self.0 {
            cache.clear();
        }
    }
}

/// Whether every `%` in `path` starts an escape (`%` and two hex digits).
fn percent_encoded_whole(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.iter().enumerate().all(|(i, &b)| {
        b != b'%'
            || bytes
                .get(i + 1..i + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lazy pool never connects: the settings are all these tests touch.
    #[cfg(feature = "postgres")]
    fn idem() -> Idem<sqlx::Postgres> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap();
        Idem::new(pool)
    }

    #[cfg(all(feature = "sqlite", not(feature = "postgres")))]
    fn idem() -> Idem<sqlx::Sqlite> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_lazy("sqlite::memory:")
            .unwrap();
        Idem::new(pool)
    }

    #[cfg(all(feature = "mysql", not(feature = "postgres"), not(feature = "sqlite")))]
    fn idem() -> Idem<sqlx::MySql> {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .connect_lazy("mysql://localhost/none")
            .unwrap();
        Idem::new(pool)
    }

    #[tokio::test]
    async fn set_cookie_can_never_be_stored() {
        assert_eq!(
            idem().with_stored_header("Set-Cookie").unwrap_err(),
            ConfigError::ForbiddenHeader("set-cookie".into())
        );
        assert!(matches!(
            idem().with_stored_header("bad header"),
            Err(ConfigError::InvalidHeader(_))
        ));
        let i = idem().with_stored_header("X-Request-Id").unwrap();
        assert!(i.stored_headers().iter().any(|h| h == "x-request-id"));
    }

    #[tokio::test]
    async fn the_operations_path_must_be_an_absolute_path() {
        assert_eq!(idem().operations_path(), "/operations");
        for bad in [
            "",
            "/",
            "operations",
            "/ops/",
            "//ops",
            "/ops?x=1",
            "/ops#a",
            "/o ps",
            "/a//b",
            "/vorgänge",
            "/ops/{tenant}",
            "/ops/*rest",
            "/\"ops\"",
            "/v1/:ops",
            "/a%zz",
            "/a%2",
        ] {
            assert_eq!(
                idem().with_operations_path(bad).unwrap_err(),
                ConfigError::InvalidOperationsPath(bad.to_owned()),
                "{bad:?}"
            );
        }
        for good in ["/v1/jobs", "/vorg%C3%A4nge", "/a-b_c.d~e/f:g@h"] {
            let i = idem().with_operations_path(good).unwrap();
            assert_eq!(i.operations_path(), good);
        }
    }
}
