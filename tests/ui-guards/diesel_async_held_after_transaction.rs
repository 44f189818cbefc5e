// A diesel-async guard taken inside diesel-async's own `conn.transaction`
// cannot be returned from its closure: it borrows the connection the
// closure is given, and the transaction ends with the closure.
use diesel_async::{AsyncConnection, AsyncPgConnection};
use lockkit_diesel_async::{AdvisoryKey, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(conn: &mut AsyncPgConnection, locker: &Locker) -> Result<(), lockkit::Error> {
    let order = conn
        .transaction::<_, lockkit::Error, _>(async |conn| {
            let mut tx = locker.lock_tx(conn)?;
            let order = tx.lock(Order { id: 1 }).await?;
            Ok(order)
        })
        .await?;
    println!("{}", order.id);
    Ok(())
}

fn main() {
    let _ = run;
}
