//! What pgbouncer 1.18 in transaction mode does with a client that goes
//! away while a statement it pipelined is still unanswered (the cause of
//! the misrouted replies the fleet's soak met, `TESTING.md`).
//!
//! pgbouncer marks a server connection ready at each `ReadyForQuery` with
//! status idle. When the client's connection then closes, a ready server
//! connection goes back to the pool at once, whether or not the client had
//! sent more: the rest of its pipeline still runs there, and its replies go
//! to whichever client the pooler hands that server connection to next.
//! Every client of the pooler can be that next client, lockkit or not.
//!
//! So lockkit never leaves a statement unanswered behind one that ends a
//! transaction, and these tests show the hazard on the real pooler.

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::Duration;

use lockkit_tests::observe::simple_value;
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

/// A client through `bouncer`, with the task that runs its connection
/// (aborted, the socket closes at once).
async fn client(bouncer: &PgBouncer) -> (Client, tokio::task::JoinHandle<()>) {
    let (client, connection) = bouncer
        .config()
        .connect(NoTls)
        .await
        .expect("connects through pgbouncer");
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    (client, task)
}

/// Polls `f` once (tokio-postgres sends a statement at its first poll);
/// whether it is still pending.
async fn poll_once<F: Future>(mut f: Pin<&mut F>) -> bool {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx).is_pending())).await
}

/// The first row's first column of a simple query's answer.
fn first_value(messages: &[SimpleQueryMessage]) -> Option<String> {
    messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
        _ => None,
    })
}

/// The hazard itself: client A pipelines two autocommit statements, reads
/// the first one's answer, and goes away. Client B's statement, on the one
/// server connection, gets A's second answer as its own: a wrong result,
/// with no error at all.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_with_a_statement_unanswered_hands_its_answer_to_the_next_client() {
    let db = TestServer::shared();
    let (mut misrouted, mut rounds) = (0, 0);
    // A round whose client A could not pipeline its two statements (its
    // connection ended at once, as when a loaded server refuses the
    // pooler's connection) shows nothing: it is run again, up to 15 times,
    // until 5 rounds did.
    for round in 0..15 {
        if rounds == 5 {
            break;
        }
        // A pooler of its own each round: once B has read A's answer, B's
        // own answer is still to come on that server connection, for
        // whoever is next.
        let bouncer = PgBouncer::one_server_connection(db);
        let (a, a_connection) = client(&bouncer).await;
        {
            let mut first = pin!(a.simple_query("SELECT 'first of A'"));
            let mut second = pin!(a.simple_query("SELECT 'second of A' FROM pg_sleep(0.2)"));
            // Each is sent at its first poll; pending, both went out.
            if !poll_once(first.as_mut()).await || !poll_once(second.as_mut()).await {
                eprintln!("round {round}: A's statements were answered at once: again");
                continue;
            }
            match first.await {
                Ok(answer) if first_value(&answer).as_deref() == Some("first of A") => {}
                other => {
                    eprintln!("round {round}: A's first answer was {other:?}: again");
                    continue;
                }
            }
            // A goes away, its second statement unanswered: the connection
            // task ends and its socket closes.
            a_connection.abort();
            let _ = a_connection.await;
        }
        drop(a);

        let b = bouncer.connect().await;
        let answer =
            tokio::time::timeout(Duration::from_secs(10), simple_value(&b, "SELECT 'of B'"))
                .await
                .expect("B is answered");
        match answer {
            Ok(value) => {
                eprintln!("round {round}: B read {value:?}");
                rounds += 1;
                if value.as_deref() != Some("of B") {
                    misrouted += 1;
                }
            }
            Err(e) => eprintln!("round {round}: B failed ({e}): again"),
        }
    }
    assert!(
        misrouted > 0,
        "pgbouncer kept A's answer from B in each of {rounds} rounds: the hazard this \
         file describes is not this pooler's"
    );
}
