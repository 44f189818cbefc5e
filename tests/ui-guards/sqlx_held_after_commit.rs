// A sqlx guard cannot be used after its transaction commits: the guard
// borrows the transaction, and `commit` takes it by value.
use lockkit_sqlx::{AdvisoryKey, Locker, SqlxResultExt};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(pool: &sqlx::PgPool, locker: &Locker) -> Result<(), lockkit::Error> {
    let mut tx = pool.begin().await.lock_err()?;
    let mut ltx = locker.lock_tx(&mut tx)?;
    let order = ltx.lock(Order { id: 1 }).await?;
    tx.commit().await.lock_err()?;
    println!("{}", order.id);
    Ok(())
}

fn main() {
    let _ = run;
}
