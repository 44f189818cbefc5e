// A diesel-async guard cannot outlive `Locker::transaction`'s closure: the
// transaction commits when the closure's future completes.
use diesel_async::AsyncPgConnection;
use lockkit_diesel_async::{AdvisoryKey, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(conn: &mut AsyncPgConnection, locker: &Locker) -> Result<(), lockkit::Error> {
    let order = locker
        .transaction(conn, |tx| {
            Box::pin(async move {
                let order = tx.lock(Order { id: 1 }).await?;
                Ok::<_, lockkit::Error>(order)
            })
        })
        .await?;
    println!("{}", order.id);
    Ok(())
}

fn main() {
    let _ = run;
}
