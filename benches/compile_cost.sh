#!/usr/bin/env bash
# The compile cost of #[idempotent]: build time of a crate with N
# annotated handlers against the same crate with N plain handlers (each opens,
# inserts and commits by hand). Both crates have the same dependencies (idem-runtime
# by path, axum, sqlx, serde, tokio at the workspace's requirements and its lock
# file) and share one target directory, so after a first build that warms the cache
# every timed run recompiles only the generated crate.
#
#   benches/compile_cost.sh                 # N=50, 5 runs of each, debug builds
#   HANDLERS=50 RUNS=7 benches/compile_cost.sh
#
# The crates are throwaway, under ${COMPILE_COST_DIR:-/tmp/idem_compile_cost}.
# Prints every run's wall-clock time and the median of each kind, for `cargo build`
# (debug, CARGO_INCREMENTAL=0: the whole crate each time) and `cargo check`.
set -euo pipefail

HANDLERS=${HANDLERS:-50}
RUNS=${RUNS:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${COMPILE_COST_DIR:-/tmp/idem_compile_cost}
export CARGO_TARGET_DIR="$DIR/target"
# Every timed build compiles the whole crate: incremental reuse would time nothing.
export CARGO_INCREMENTAL=0

version() { # a workspace dependency's requirement as written, e.g. "0.8" (the
    # copied Cargo.lock picks the version the workspace builds)
    grep -E "^$1 = " "$ROOT/Cargo.toml" | grep -oE '(version = |^[a-z_-]+ = )"[^"]+"' | head -n1 |
        grep -oE '"[^"]+"' | tr -d '"'
}

manifest() { # $1: crate name
    cat <<EOF
[package]
name = "$1"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
idem-runtime = { path = "$ROOT/idem-runtime" }
axum = { version = "$(version axum)", default-features = false, features = ["json", "form", "matched-path", "query", "tokio", "http1"] }
sqlx = { version = "$(version sqlx)", default-features = false, features = ["runtime-tokio", "postgres", "macros", "migrate", "json"] }
serde = { version = "$(version serde)", features = ["derive"] }
tokio = { version = "$(version tokio)", features = ["rt-multi-thread", "macros", "time", "sync", "net", "signal"] }

[workspace]
EOF
}

prelude() {
    cat <<'EOF'
use axum::extract::{FromRef, FromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::{Idem, TenantScope};
use serde::{Deserialize, Serialize};

#[derive(Clone)]
pub struct AppState {
    pub idem: Idem<sqlx::Postgres>,
    pub pool: sqlx::PgPool,
}

impl FromRef<AppState> for Idem<sqlx::Postgres> {
    fn from_ref(s: &AppState) -> Idem<sqlx::Postgres> {
        s.idem.clone()
    }
}

pub struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(|t| Caller(t.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[derive(Deserialize, Serialize)]
pub struct Cmd {
    name: String,
    amount: i64,
}

#[derive(Serialize)]
pub struct Out {
    id: i64,
}

type ApiError = (StatusCode, String);

fn db(e: sqlx::Error) -> ApiError {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}
EOF
}

generate() { # $1: annotated | plain
    local kind=$1 crate="$DIR/$1"
    mkdir -p "$crate/src"
    manifest "cc_$kind" >"$crate/Cargo.toml"
    cp "$ROOT/Cargo.lock" "$crate/Cargo.lock"
    {
        prelude
        if [ "$kind" = annotated ]; then
            echo "use idem_runtime::{Tx, idempotent};"
        else
            echo "use axum::extract::State;"
        fi
        for i in $(seq 1 "$HANDLERS"); do
            if [ "$kind" = annotated ]; then
                cat <<EOF

#[idempotent(operation = "op-$i", retention = "24h")]
pub async fn handler_$i(
    #[tenant] caller: Caller,
    tx: &mut Tx<sqlx::Postgres>,
    Json(cmd): Json<Cmd>,
) -> Result<(StatusCode, Json<Out>), ApiError> {
    let id: i64 = sqlx::query_scalar("INSERT INTO t$i (tenant, name, amount) VALUES (\$1, \$2, \$3) RETURNING id")
        .bind(&caller.0)
        .bind(&cmd.name)
        .bind(cmd.amount)
        .fetch_one(&mut **tx)
        .await
        .map_err(db)?;
    Ok((StatusCode::CREATED, Json(Out { id })))
}
EOF
            else
                cat <<EOF

pub async fn handler_$i(
    caller: Caller,
    State(state): State<AppState>,
    Json(cmd): Json<Cmd>,
) -> Result<(StatusCode, Json<Out>), ApiError> {
    let mut tx = state.pool.begin().await.map_err(db)?;
    let id: i64 = sqlx::query_scalar("INSERT INTO t$i (tenant, name, amount) VALUES (\$1, \$2, \$3) RETURNING id")
        .bind(&caller.0)
        .bind(&cmd.name)
        .bind(cmd.amount)
        .fetch_one(&mut *tx)
        .await
        .map_err(db)?;
    tx.commit().await.map_err(db)?;
    Ok((StatusCode::CREATED, Json(Out { id })))
}
EOF
            fi
        done
        echo
        echo "pub fn router(state: AppState) -> Router {"
        echo "    Router::new()"
        for i in $(seq 1 "$HANDLERS"); do
            echo "        .route(\"/r$i\", post(handler_$i))"
        done
        echo "        .with_state(state)"
        echo "}"
    } >"$crate/src/lib.rs"
}

now() { date +%s.%N; }

median() { sort -n | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.2f\n", (a[NR/2]+a[NR/2+1])/2}'; }

generate annotated
generate plain

echo "compile cost: $HANDLERS handlers per crate, $RUNS timed runs each, in $DIR" >&2
echo "warming the dependency cache ..." >&2
for kind in annotated plain; do
    (cd "$DIR/$kind" && cargo build --offline --quiet && cargo check --offline --quiet)
done

declare -A times
for run in $(seq 1 "$RUNS"); do
    for cmd in build check; do
        for kind in annotated plain; do
            touch "$DIR/$kind/src/lib.rs"
            start=$(now)
            (cd "$DIR/$kind" && cargo "$cmd" --offline --quiet)
            t=$(echo "$(now) - $start" | bc -l)
            times[$cmd.$kind]+="$t "
            printf 'run %d %-5s %-9s %.2f s\n' "$run" "$cmd" "$kind" "$t"
        done
    done
done
for cmd in build check; do
    for kind in annotated plain; do
        printf 'median %-5s %-9s %.2f s\n' "$cmd" "$kind" \
            "$(echo "${times[$cmd.$kind]}" | tr ' ' '\n' | grep . | median)"
    done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
