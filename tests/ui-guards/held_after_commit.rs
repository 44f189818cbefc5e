// A guard cannot be used after its transaction commits: `commit` takes the
// `LockTx` by value while the guard still borrows it.
use lockkit::{AdvisoryKey, Config, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
    let locker = Locker::new(client, Config::default()).await?;
    let tx = locker.begin(client).await?;
    let order = tx.lock(Order { id: 1 }).await?;
    tx.commit().await?;
    println!("{}", order.id);
    Ok(())
}

fn main() {
    let _ = run;
}
