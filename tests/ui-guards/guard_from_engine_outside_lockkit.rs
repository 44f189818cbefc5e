// A guard proves its key is held: only lockkit's engine makes one, from a
// reply it checked. Outside lockkit neither the engine's grant nor a
// transaction's bookkeeping fed made-up replies can be reached.
use lockkit::{AdvisoryKey, Held, HeldBatch};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

fn through_the_driver(value: Order) -> Held<'static, Order> {
    let state = lockkit::driver::TxState::new();
    let _ = state;
    lockkit::driver::Grant::lock(Err(lockkit::Error::other("made up")), value).unwrap()
}

fn through_the_engine() -> HeldBatch<'static> {
    lockkit::engine::Grant::lock_batch(Err(lockkit::Error::other("made up"))).unwrap()
}

fn main() {
    let _ = (through_the_driver, through_the_engine);
}
