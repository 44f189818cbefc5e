// A sqlx guard cannot outlive `Locker::transaction`'s closure: the
// transaction commits when the closure's future completes.
use lockkit_sqlx::{AdvisoryKey, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(pool: &sqlx::PgPool, locker: &Locker) -> Result<(), lockkit::Error> {
    let order = locker
        .transaction(pool, |tx| {
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
