// A batch guard cannot be used after its transaction rolls back.
use lockkit::{AdvisoryKey, Batch, Config, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
    let locker = Locker::new(client, Config::default()).await?;
    let tx = locker.begin(client).await?;
    let batch = Batch::new().with(&Order { id: 1 }).with(&Order { id: 2 });
    let held = tx.lock_batch(&batch).await?;
    tx.rollback().await?;
    println!("{}", held.keys().len());
    Ok(())
}

fn main() {
    let _ = run;
}
