//! A UI-style edit lock that fails fast: "another user is editing this
//! order" at once, instead of a spinner (the notes' `NOWAIT` advice, with an
//! advisory try-lock on the order).
//!
//! ```sh
//! cargo run -p lockkit-examples --bin edit_lock
//! ```
//!
//! Alice opens order 42 and edits it for a second. Bob opens it meanwhile
//! and is told at once that someone else is editing it; Bob can still edit
//! order 7. Dave's screen, written with a waiting lock, spins until Alice
//! saves. When Alice has saved, Bob tries again and gets the order.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Config, Locker};
use lockkit_examples::Database;
use tokio_postgres::Client;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The right to edit one order.
#[derive(AdvisoryKey, Debug, Clone, Copy)]
struct OrderEdit {
    order_id: i64,
}

struct Clock(Instant);

impl Clock {
    fn say(&self, who: &str, what: impl std::fmt::Display) {
        println!("[{:>7.3}s] {who:<6} {what}", self.0.elapsed().as_secs_f64());
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let db = Database::from_env(&[]);
    match run(&db).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("edit_lock: the scenario did not go as described");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("edit_lock: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(db: &Database) -> Result<bool, BoxError> {
    let admin = db.connect().await?;
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS orders;
             CREATE TABLE orders (id int8 PRIMARY KEY, note text NOT NULL, edits text[] NOT NULL DEFAULT '{}');
             INSERT INTO orders (id, note) VALUES (42, 'two chairs'), (7, 'one table');",
        )
        .await?;
    let locker = Locker::new(&admin, Config::default()).await?;
    let clock = Arc::new(Clock(Instant::now()));

    let alice = {
        let (locker, mut client) = (locker.clone(), db.connect().await?);
        let clock = Arc::clone(&clock);
        tokio::spawn(async move {
            let tx = locker.begin(&mut client).await?;
            let Ok(order) = tx.try_lock(OrderEdit { order_id: 42 }).await? else {
                return Err::<bool, BoxError>("alice should get order 42".into());
            };
            clock.say("alice", "opened order 42 for editing");
            tokio::time::sleep(Duration::from_millis(1000)).await; // typing
            save(&tx, order.order_id, "alice: three chairs").await?;
            tx.commit().await?;
            clock.say("alice", "saved order 42 (COMMIT released the edit lock)");
            Ok(true)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Bob: fail fast.
    let mut bob = db.connect().await?;
    let bob_first = open_for_edit(&locker, &mut bob, 42, "bob", &clock, None).await?;
    let bob_other = open_for_edit(
        &locker,
        &mut bob,
        7,
        "bob",
        &clock,
        Some("bob: one oak table"),
    )
    .await?;

    // Dave: the same screen written with a waiting lock.
    let mut dave = db.connect().await?;
    let start = Instant::now();
    {
        let tx = locker.begin(&mut dave).await?;
        clock.say(
            "dave",
            "opens order 42 with a waiting lock (lock() instead of try_lock())… spinner",
        );
        let _order = tx.lock(OrderEdit { order_id: 42 }).await?;
        clock.say(
            "dave",
            format_args!(
                "got it after a {:.0} ms spinner, once alice saved; closes without changes",
                start.elapsed().as_secs_f64() * 1000.0
            ),
        );
        tx.rollback().await?;
    }
    let dave_waited = start.elapsed() >= Duration::from_millis(500);

    let alice_saved = alice.await??;
    let bob_again = open_for_edit(
        &locker,
        &mut bob,
        42,
        "bob",
        &clock,
        Some("bob: three red chairs"),
    )
    .await?;

    let edits: Vec<String> = admin
        .query_one("SELECT edits FROM orders WHERE id = 42", &[])
        .await?
        .get(0);
    println!("\norder 42 edits, in order: {edits:?}");
    let ok = alice_saved
        && !bob_first
        && bob_other
        && dave_waited
        && bob_again
        && edits == ["alice: three chairs", "bob: three red chairs"];
    Ok(ok)
}

/// The "edit order" screen: takes the order's edit lock without waiting,
/// or tells the user at once that someone else is editing it. Answers
/// whether the user got to edit.
async fn open_for_edit(
    locker: &Locker,
    client: &mut Client,
    order_id: i64,
    who: &str,
    clock: &Clock,
    edit: Option<&str>,
) -> Result<bool, BoxError> {
    let tx = locker.begin(client).await?;
    let start = Instant::now();
    match tx.try_lock(OrderEdit { order_id }).await? {
        Err(busy) => {
            clock.say(
                who,
                format_args!(
                    "\"another user is editing order {}\" (answered in {:.1} ms, no spinner)",
                    busy.order_id,
                    start.elapsed().as_secs_f64() * 1000.0
                ),
            );
            tx.rollback().await?;
            Ok(false)
        }
        Ok(order) => {
            clock.say(
                who,
                format_args!("opened order {} for editing", order.order_id),
            );
            if let Some(text) = edit {
                save(&tx, order.order_id, text).await?;
                clock.say(who, format_args!("saved order {}", order.order_id));
            }
            tx.commit().await?;
            Ok(true)
        }
    }
}

async fn save(
    tx: &tokio_postgres::Transaction<'_>,
    order_id: i64,
    text: &str,
) -> Result<(), BoxError> {
    tx.execute(
        "UPDATE orders SET edits = edits || $2::text WHERE id = $1",
        &[&order_id, &text],
    )
    .await?;
    Ok(())
}
