//! What the money-transfer examples (`transfer_diesel`, `transfer_sqlx`,
//! `transfer_diesel_async`) count and how they judge a run: the same for
//! every stack, so that their outputs compare.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Transfers by outcome, counted by every worker.
#[derive(Debug, Default)]
pub struct Tally {
    /// Transfers that moved the money.
    pub done: AtomicU64,
    /// Transfers refused because the payer could not afford them.
    pub insufficient: AtomicU64,
    /// Transfers the server aborted as deadlocked.
    pub deadlocks: AtomicU64,
}

impl Tally {
    /// Prints the run's figures and judges it. `transfers` is how many were
    /// attempted, on `workers` between `accounts` accounts; `locked` says
    /// whether the accounts were locked (`how`, e.g. "(sqlx)") or this is
    /// the control; `before` and `after` are the money in all accounts.
    ///
    /// A locked run fails unless the money was conserved with no deadlock;
    /// the control fails unless it shows what the locks prevent (lost
    /// money or a deadlock), for otherwise it proves nothing.
    pub fn report(
        &self,
        workers: &str,
        accounts: i64,
        transfers: usize,
        (locked, how): (bool, &str),
        (before, after): (i64, i64),
    ) -> ExitCode {
        let (done, insufficient, deadlocks) = (
            self.done.load(Relaxed),
            self.insufficient.load(Relaxed),
            self.deadlocks.load(Relaxed),
        );
        println!(
            "{transfers} transfers on {workers} between {accounts} accounts, both directions, {}",
            if locked {
                format!("accounts locked in global order{how}")
            } else {
                "WITHOUT locks (control)".to_owned()
            }
        );
        println!("  done:         {done}");
        println!("  insufficient: {insufficient}");
        println!("  deadlocks:    {deadlocks}");
        println!("  money before: {before}");
        println!("  money after:  {after}");
        let conserved = before == after;
        println!(
            "  {}",
            if conserved {
                "money conserved"
            } else {
                "MONEY NOT CONSERVED"
            }
        );
        if locked && !(conserved && deadlocks == 0) {
            return ExitCode::FAILURE;
        }
        if !locked && conserved && deadlocks == 0 {
            println!("  the control showed neither lost money nor a deadlock");
            return ExitCode::FAILURE;
        }
        ExitCode::SUCCESS
    }
}
