// There is no way to take an xact lock outside a transaction: neither the
// client nor the locker has a lock method; only a `LockTx` (made by
// `Locker::begin` or `Locker::lock_tx`) does.
use lockkit::{AdvisoryKey, Config, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
    let locker = Locker::new(client, Config::default()).await?;
    let _ = client.lock(Order { id: 1 }).await?;
    let _ = locker.lock(Order { id: 2 }).await?;
    Ok(())
}

fn main() {
    let _ = run;
}
