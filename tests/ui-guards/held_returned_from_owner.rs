// A guard cannot leave the function that owns its transaction: the
// transaction ends there (dropped: rolled back), and so do its locks.
use lockkit::{AdvisoryKey, Config, Held, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn lock_order<'c>(
    client: &'c mut tokio_postgres::Client,
) -> Result<Held<'c, Order>, lockkit::Error> {
    let locker = Locker::new(client, Config::default()).await?;
    let tx = locker.begin(client).await?;
    let order = tx.lock(Order { id: 1 }).await?;
    Ok(order)
}

fn main() {
    let _ = lock_order;
}
