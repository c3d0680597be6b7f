// The method runs on a task of its own, which owns a clone of the service.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

mod other {
    use super::*;

    pub struct Service {
        pub idem: Idem<Postgres>,
    }

    impl FromRef<Service> for Idem<Postgres> {
        fn from_ref(s: &Service) -> Idem<Postgres> {
            s.idem.clone()
        }
    }

    #[tonic::async_trait]
    impl Orders for Service {
        #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
        async fn create_order(
            &self,
            #[tenant] caller: Extension<Caller>,
            tx: &mut Tx<Postgres>,
            request: Request<CreateOrderRequest>,
        ) -> Result<Response<Order>, Status> {
            Ok(Response::new(Order { id: 1 }))
        }
    }
}

fn main() {}
