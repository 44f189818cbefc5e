// A guard proves its key is held: outside lockkit it cannot be written as
// a struct literal (its fields are private, and it has no constructor).
use lockkit::{AdvisoryKey, Held, LockKey, Mode};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

fn forged(value: Order) -> Held<'static, Order> {
    Held {
        value,
        key: LockKey::BigInt(1),
        mode: Mode::Exclusive,
        _tx: std::marker::PhantomData,
    }
}

fn main() {
    let _ = forged;
}
