"""A client nobody here wrote: Python's grpcio, with stubs generated from
proto/orders.proto by grpcio-tools, drives the grpc-orders example.

    python grpcio_client.py HOST:PORT PROTO_DIR

Prints one line per scenario and `N passed, M failed`; exits 1 on a failure.
"""

import concurrent.futures
import importlib
import sys
import tempfile
import traceback
import uuid

import grpc
from grpc_tools import protoc

ADDR, PROTO_DIR = sys.argv[1], sys.argv[2]
OUT = tempfile.mkdtemp(prefix="idem-grpcio-")
if protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={OUT}",
                f"--grpc_python_out={OUT}", f"{PROTO_DIR}/orders.proto"]) != 0:
    sys.exit("protoc failed")
sys.path.insert(0, OUT)
pb = importlib.import_module("orders_pb2")
rpc = importlib.import_module("orders_pb2_grpc")

channel = grpc.insecure_channel(ADDR)
stub = rpc.OrdersStub(channel)
TENANT = "py-" + uuid.uuid4().hex[:12]


def meta(key=None, currency="EUR"):
    m = [("authorization", f"Bearer {TENANT}"), ("x-currency", currency)]
    if key is not None:
        m.append(("idempotency-key", key))
    return m


def create(key, sku="kettle", **kw):
    request = pb.CreateOrderRequest(sku=sku, quantity=1, amount_cents=990, **kw)
    return stub.CreateOrder.with_call(request, metadata=meta(key))


def replayed(call):
    return ("idempotent-replayed", "true") in (call.trailing_metadata() or []) or \
        ("idempotent-replayed", "true") in (call.initial_metadata() or [])


def counts():
    return stub.CountOrders(pb.CountOrdersRequest(), metadata=meta())


def a_retry_replays_the_first_answer():
    first, call = create("py-1")
    assert not replayed(call)
    again, call = create("py-1")
    assert replayed(call), call.initial_metadata()
    assert again == first, (again, first)


def field_order_and_defaults_do_not_change_the_request():
    # Labels in another insertion order, a default written out: one request.
    a, _ = create("py-2", labels={"a": "1", "b": "2"})
    b, call = create("py-2", labels={"b": "2", "a": "1"}, note="")
    assert replayed(call) and a == b


def another_message_is_failed_precondition():
    create("py-3", sku="kettle")
    try:
        create("py-3", sku="toaster")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
        return
    raise AssertionError("a reused key was accepted")


def a_missing_key_is_invalid_argument():
    try:
        stub.CreateOrder(pb.CreateOrderRequest(sku="x", quantity=1), metadata=meta())
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "idempotency-key" in e.details(), e.details()
        return
    raise AssertionError("a call without a key ran")


def a_stored_not_found_replays():
    request = pb.CreateRefundRequest(order_id=424242, amount_cents=5, request_id=str(uuid.uuid4()))
    codes = []
    for _ in range(2):
        try:
            stub.CreateRefund(request, metadata=meta())
        except grpc.RpcError as e:
            codes.append((e.code(), dict(e.trailing_metadata() or []).get("idempotent-replayed")))
    assert codes == [(grpc.StatusCode.NOT_FOUND, None), (grpc.StatusCode.NOT_FOUND, "true")], codes


def concurrent_duplicates_make_one_order():
    before = counts().orders
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = {o.id for o, _ in pool.map(lambda _: create("py-dup", sku="crate"), range(8))}
    assert len(ids) == 1, ids
    assert counts().orders == before + 1


SCENARIOS = [
    a_retry_replays_the_first_answer,
    field_order_and_defaults_do_not_change_the_request,
    another_message_is_failed_precondition,
    a_missing_key_is_invalid_argument,
    a_stored_not_found_replays,
    concurrent_duplicates_make_one_order,
]

passed = failed = 0
for scenario in SCENARIOS:
    try:
        scenario()
        passed += 1
        print(f"ok   {scenario.__name__}")
    except Exception:  # noqa: BLE001 - every failure is reported, then counted
        failed += 1
        print(f"FAIL {scenario.__name__}")
        traceback.print_exc()
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
