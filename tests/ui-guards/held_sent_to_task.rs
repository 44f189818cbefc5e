// A guard cannot be sent to a spawned task: the task may outlive the
// transaction (`tokio::spawn` needs `'static`), and the guard borrows it.
use lockkit::{AdvisoryKey, Config, Locker};

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
    let locker = Locker::new(client, Config::default()).await?;
    let tx = locker.begin(client).await?;
    let order = tx.lock(Order { id: 1 }).await?;
    tokio::spawn(async move {
        println!("{}", order.id);
    });
    tx.commit().await
}

fn main() {
    let _ = run;
}
