// `Uncertain` in a transactional handler's return type: a leased handler's
// answer, refused at its name with the way to leased mode.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

use idem_runtime::Uncertain;

#[idempotent(operation = "create-payment", retention = "24h")]
async fn create_payment(
    #[tenant] caller: Caller,
    tx: &mut Tx<Postgres>,
    Json(cmd): Json<NewOrder>,
) -> Result<StatusCode, Uncertain> {
    Err(Uncertain::new("the provider timed out"))
}

fn main() {
    let _: Router = Router::new().route("/payments", post(create_payment)).with_state(idem());
}
