// Shared by the gRPC trybuild cases (`include!`d): a service trait as
// tonic-prost-build generates it (`#[tonic::async_trait]`, `Send + Sync +
// 'static`), its messages, a caller an interceptor inserts, and the service
// that provides the `Idem`.
use axum::extract::FromRef;
use axum::Extension;
use idem_runtime::{idempotent, Idem, Lease, TenantScope, Tx};
use sqlx::Postgres;
use tonic::{Request, Response, Status};

#[derive(Clone)]
struct Caller(String);
impl TenantScope for Caller {
    fn tenant_id(&self) -> &str {
        &self.0
    }
}

#[derive(Clone, PartialEq, prost::Message)]
struct CreateOrderRequest {
    #[prost(string, tag = "1")]
    sku: String,
    #[prost(int32, tag = "2")]
    quantity: i32,
    #[prost(string, tag = "3")]
    request_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(int64, tag = "1")]
    id: i64,
}

#[tonic::async_trait]
trait Orders: Send + Sync + 'static {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status>;

    // A client-streaming method, with a default body so that the cases that
    // do not implement it need not.
    async fn import_orders(
        &self,
        request: Request<tonic::Streaming<CreateOrderRequest>>,
    ) -> Result<Response<Order>, Status> {
        let _ = request;
        Err(Status::unimplemented("import_orders"))
    }
}

#[derive(Clone)]
struct Service {
    idem: Idem<Postgres>,
}

impl FromRef<Service> for Idem<Postgres> {
    fn from_ref(s: &Service) -> Idem<Postgres> {
        s.idem.clone()
    }
}
