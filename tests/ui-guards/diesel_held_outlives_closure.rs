// A Diesel guard cannot outlive `Locker::transaction`'s closure: the
// transaction commits when the closure returns.
use diesel::PgConnection;
use lockkit_diesel::{AdvisoryKey, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

fn run(conn: &mut PgConnection, locker: &Locker) -> Result<(), lockkit::Error> {
    let order = locker.transaction::<_, lockkit::Error, _>(conn, |tx| {
        let order = tx.lock(Order { id: 1 })?;
        Ok(order)
    })?;
    println!("{}", order.id);
    Ok(())
}

fn main() {
    let _ = run;
}
