// A guard cannot be moved out of the block that owns its transaction.
use lockkit::{AdvisoryKey, Config, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
    let locker = Locker::new(client, Config::default()).await?;
    let order;
    {
        let tx = locker.begin(client).await?;
        order = tx.lock(Order { id: 1 }).await?;
    }
    println!("{}", order.id);
    Ok(())
}

fn main() {
    let _ = run;
}
