// A Diesel `LockTx` cannot be used inside a nested `conn.transaction` it did
// not open: it borrows the connection for as long as it lives.
use diesel::{Connection, PgConnection};
use lockkit_diesel::{AdvisoryKey, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

fn run(conn: &mut PgConnection, locker: &Locker) -> Result<(), lockkit::Error> {
    conn.transaction::<_, lockkit::Error, _>(|conn| {
        let mut tx = locker.lock_tx(conn)?;
        let _first = tx.lock(Order { id: 1 })?;
        conn.transaction::<_, lockkit::Error, _>(|_inner| {
            let _second = tx.lock(Order { id: 2 })?;
            Ok(())
        })
    })
}

fn main() {
    let _ = run;
}
