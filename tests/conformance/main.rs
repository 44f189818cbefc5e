//! The conformance suite: one set of tests, written once against an
//! adapter-neutral [`Session`](session::Session), run on every PostgreSQL
//! stack lockkit supports (tokio-postgres, blocking Diesel, diesel-async,
//! sqlx) on a real server, plus exclusion across every pair of stacks.
//! `cargo test -p lockkit-tests --test conformance sqlx::` runs one stack.

mod adapters;
mod handoff;
mod session;
mod suite;

/// Instantiates the named test bodies of [`suite`] for one adapter, in a
/// module named after the stack.
macro_rules! suite {
    ($stack:ident: $adapter:ty; $($test:ident),* $(,)?) => {
        mod $stack {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    crate::suite::$test::<$adapter>().await
                }
            )*
        }
    };
}

suite!(tokio_postgres: crate::adapters::with_tokio_postgres::TokioPg;
    exclusion, exclusion_control, deadlock_freedom, deadlock_control,
    release_on_commit, release_on_rollback, release_on_drop, release_on_panic,
    release_on_terminate, budget, timeout, cancel, savepoints, drifting_key, semaphore,
    commit_after_an_aborting_error, statement_mode_decides_what_is_prepared,
    fencing_tokens,
    // No lock_outside_transaction_refused: it does not compile
    // (tests/ui-guards/lock_without_transaction.rs). No
    // a_lock_calls_statements_are_reported_inside_its_span: tokio-postgres
    // reports its statements to no `tracing` target (`STATEMENT_EVENTS`).
);

suite!(sqlx: crate::adapters::with_sqlx::Sqlx;
    exclusion, exclusion_control, deadlock_freedom, deadlock_control,
    release_on_commit, release_on_rollback, release_on_drop, release_on_panic,
    release_on_terminate, budget, timeout, cancel, savepoints, drifting_key, semaphore,
    lock_outside_transaction_refused, statement_mode_decides_what_is_prepared,
    a_lock_calls_statements_are_reported_inside_its_span, fencing_tokens,
    // Not commit_after_an_aborting_error but its control: this stack's
    // sessions commit through sqlx's own `Transaction::commit` (`lock_tx`),
    // which is not lockkit's to refuse (`Locker::lock_tx` says so);
    // lockkit's closure form is tested in tests/sqlx/api.rs.
    commit_after_an_aborting_error_control,
);

suite!(diesel_async: crate::adapters::with_diesel_async::DieselAsync;
    exclusion, exclusion_control, deadlock_freedom, deadlock_control,
    release_on_commit, release_on_rollback, release_on_drop, release_on_panic,
    release_on_terminate, budget, timeout, cancel, savepoints, drifting_key, semaphore,
    lock_outside_transaction_refused, statement_mode_decides_what_is_prepared,
    a_lock_calls_statements_are_reported_inside_its_span, fencing_tokens,
    // Not commit_after_an_aborting_error but its control: this stack's
    // sessions commit through diesel-async's own `conn.transaction`
    // (`lock_tx`), which is not lockkit's to refuse (`Locker::lock_tx` says
    // so); lockkit's closure form is tested in tests/diesel_async/api.rs.
    commit_after_an_aborting_error_control,
);

suite!(diesel: crate::adapters::with_diesel::Diesel;
    exclusion, exclusion_control, deadlock_freedom, deadlock_control,
    release_on_commit, release_on_rollback, release_on_panic,
    release_on_terminate, budget, timeout, savepoints, drifting_key, semaphore,
    commit_after_an_aborting_error,
    lock_outside_transaction_refused, statement_mode_decides_what_is_prepared,
    a_lock_calls_statements_are_reported_inside_its_span, fencing_tokens,
    // No release_on_drop: a blocking transaction closure cannot be
    // abandoned half-way, only unwound (release_on_panic). No cancel: no
    // futures; lock_timeout is the bound (timeout).
);

/// Exclusion across every pair of stacks, both directions in each test.
mod cross {
    use crate::adapters::with_diesel::Diesel;
    use crate::adapters::with_diesel_async::DieselAsync;
    use crate::adapters::with_sqlx::Sqlx;
    use crate::adapters::with_tokio_postgres::TokioPg;
    use crate::suite::cross;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokio_postgres_and_sqlx() {
        cross::<TokioPg, Sqlx>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokio_postgres_and_diesel_async() {
        cross::<TokioPg, DieselAsync>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokio_postgres_and_diesel() {
        cross::<TokioPg, Diesel>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_and_diesel_async() {
        cross::<Sqlx, DieselAsync>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_and_diesel() {
        cross::<Sqlx, Diesel>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn diesel_async_and_diesel() {
        cross::<DieselAsync, Diesel>().await;
    }
}

/// No pooled connection handed on inside a transaction, on every stack,
/// however a lock call is cut off (`handoff`).
mod handoff_tests {
    use crate::handoff::{self, no_connection_handed_on_inside_a_transaction as scenario};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx() {
        scenario::<handoff::with_sqlx::SqlxPool>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn diesel_async() {
        scenario::<handoff::with_diesel_async::DieselAsyncPool>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokio_postgres() {
        scenario::<handoff::with_tokio_postgres::DeadpoolPg>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn diesel() {
        scenario::<handoff::with_diesel::DieselPool>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control() {
        handoff::control_a_connection_handed_on_inside_a_transaction().await;
    }
}
