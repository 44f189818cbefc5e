//! The general lock call ([`Acquisition`]): any request, any wait, round
//! by round, each round's replies checked.

use smallvec::SmallVec;

use super::grant::Grant;
use super::ledger::{Granted, Ledger};
use super::one_call::{check_one, one_bigint, one_pair};
use super::request::Keys;
use super::{Policy, Request, TxState, Wait};
use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::guard::Busy;
use crate::engine::plan::{Mode, Plan};
use crate::engine::sql::timeout_millis;
use crate::engine::statement::{minted, Param, Reply, ReplyShape, Round, Sql, Statement};
use crate::fencing::FencingToken;
use crate::key::LockKey;

impl TxState {
    /// Starts acquiring `request` at savepoint `depth` under `policy`:
    /// checks everything that needs no round trip and plans the statements.
    /// On success the transaction counts as having a lock call in flight
    /// until the [`Acquisition`] is finished; dropped unfinished, it poisons
    /// the transaction.
    ///
    /// A one-key call that waits as long as it takes, or not at all, is one
    /// statement: [`TxState::acquire_one`] runs it with less work.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::HotStandby`], [`ErrorKind::HashtextMismatch`],
    /// [`ErrorKind::Poisoned`], [`ErrorKind::LockInFlight`],
    /// [`ErrorKind::TransactionAborted`], [`ErrorKind::BudgetExceeded`] and
    /// [`ErrorKind::LockOrder`] (when configured); nothing is to be sent.
    pub(crate) fn acquire<'a>(
        &'a self,
        policy: &Policy,
        depth: u32,
        request: Request,
        wait: Wait,
    ) -> Result<Acquisition<'a>, Error> {
        let (locks, plan) = self.open(policy, &request, wait != Wait::Try)?;
        let empty = plan.is_empty();
        let ledger = Ledger::start(
            self,
            locks,
            (depth, request.site),
            request.key_type,
            plan.len(),
            wait,
        );
        Ok(Acquisition {
            ledger,
            plan,
            request,
            wait,
            mint: policy.config().mints_tokens(),
            sliced: false,
            token: None,
            stage: if empty {
                Stage::Finished(Ok(Granted::Now))
            } else {
                Stage::Main
            },
        })
    }
}

/// The SQLSTATE of a lock wait that reached its `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// What [`Acquisition::check`] read of a round's replies.
struct Checked {
    /// A try's busy keys.
    busy: Vec<LockKey>,
    /// The token minted with the grant.
    token: Option<FencingToken>,
    /// Whether a bounded wait was lockkit's slice, when the round says.
    sliced: Option<bool>,
}

#[derive(Debug)]
enum Stage {
    /// The lock statements are to be sent.
    Main,
    /// A try-batch savepoint is to be released (all granted) or rolled back
    /// (busy keys).
    Settle(Vec<LockKey>),
    /// A failure is to be undone by rolling back lockkit's savepoint.
    Recover(Error),
    /// A bounded wait's failure, its savepoint rolled back, is to abort the
    /// transaction, as the same failure of an unbounded wait does.
    Abort(Error),
    Finished(Result<Granted, Error>),
}

/// One lock call in flight: the statements to send, round by round, and the
/// checked outcome. Dropping it unfinished poisons the transaction, since the
/// server may have granted what was sent.
#[derive(Debug)]
#[must_use = "an acquisition must be driven to its outcome, or it poisons the transaction"]
pub(crate) struct Acquisition<'a> {
    ledger: Ledger<'a>,
    plan: Plan,
    request: Request,
    wait: Wait,
    /// Whether the round's last lock statement mints a fencing token.
    mint: bool,
    /// Whether the call waits in server-side slices
    /// ([`Policy::bounds_waits`]): a call that waits as long as it takes,
    /// under a policy that bounds waits.
    sliced: bool,
    /// The token minted with the grant.
    token: Option<FencingToken>,
    stage: Stage,
}

impl Acquisition<'_> {
    /// The same call, waiting in server-side slices when `bounded` and it
    /// waits as long as it takes ([`Policy::bounds_waits`]; the caller
    /// knows whether its driver's calls can be cut off in flight).
    pub(crate) fn sliced(mut self, bounded: bool) -> Self {
        self.sliced = bounded && self.wait == Wait::Forever;
        self
    }

    /// The statements to send now, in this order (pipelined where the driver
    /// can), or `None` when the outcome is known: call
    /// [`Acquisition::finish`].
    pub(crate) fn round(&self) -> Option<Round<'_>> {
        if let Stage::Finished(_) = self.stage {
            return None;
        }
        let plan = &self.plan;
        let mut out = Round::new();
        match &self.stage {
            Stage::Finished(_) => return None,
            Stage::Recover(_) => {
                out.push(Statement::new(Sql::Rollback, &[]));
                if self.sliced {
                    out.push(Statement::new(Sql::EndSlice, &[]));
                }
            }
            Stage::Settle(busy) if busy.is_empty() => out.push(Statement::new(Sql::Release, &[])),
            Stage::Settle(_) => out.push(Statement::new(Sql::Rollback, &[])),
            Stage::Abort(_) => out.push(Statement::new(Sql::AbortTransaction, &[])),
            Stage::Main => match self.wait {
                // One slice of the wait: armed before the savepoint, so
                // that the recovery round can read whose timeout it was.
                Wait::Forever if self.sliced => {
                    out.push(Statement::new(Sql::ArmSlice, &[]));
                    out.push(Statement::new(Sql::Savepoint, &[]));
                    self.lock_statements(&mut out);
                    out.push(Statement::new(Sql::Release, &[]));
                    out.push(Statement::new(Sql::EndSlice, &[]));
                }
                Wait::Forever => self.lock_statements(&mut out),
                Wait::Timeout(timeout) => {
                    out.push(Statement::new(Sql::Savepoint, &[]));
                    out.push(Statement::new(
                        Sql::SetTimeouts,
                        &[Param::Int8(timeout_millis(timeout))],
                    ));
                    self.lock_statements(&mut out);
                    out.push(Statement::new(Sql::RestoreTimeouts, &[]));
                    out.push(Statement::new(Sql::Release, &[]));
                }
                Wait::Try if plan.len() == 1 => out.push(self.one_key(true)),
                Wait::Try => {
                    out.push(Statement::new(Sql::Savepoint, &[]));
                    if !plan.bigint().is_empty() {
                        out.push(Statement::new(
                            Sql::TryBatchBigint,
                            &[
                                Param::Int8Array(plan.bigint()),
                                Param::BoolArray(plan.bigint_shared()),
                            ],
                        ));
                    }
                    if !plan.pair_classes().is_empty() {
                        out.push(Statement::new(
                            Sql::TryBatchPair,
                            &[
                                Param::Int4Array(plan.pair_classes()),
                                Param::Int4Array(plan.pair_objects()),
                                Param::BoolArray(plan.pair_shared()),
                            ],
                        ));
                    }
                }
            },
        }
        // The token, read in the main round's last lock statement, after
        // every lock of the call (inside its savepoint, where it has one).
        if let Stage::Main = self.stage {
            out.mint_last_take(self.mint);
        }
        Some(out)
    }

    /// The statement that takes the plan's one key: the lock, or its try.
    fn one_key(&self, try_only: bool) -> Statement<'_> {
        let plan = &self.plan;
        let shared = plan.modes().next() == Some(Mode::Shared);
        match (plan.bigint(), plan.pair_classes()) {
            ([k], []) => one_bigint(*k, shared, try_only),
            ([], [c]) => one_pair(*c, plan.pair_objects()[0], shared, try_only),
            _ => unreachable!("a plan of one key has one key"),
        }
    }

    /// The lock statements of the plan: `BigInt` keys first, then `Pair`
    /// keys; under a timeout, the second re-armed with what is left of it.
    fn lock_statements<'s>(&'s self, out: &mut Round<'s>) {
        let plan = &self.plan;
        let (big, pair) = (plan.bigint(), plan.pair_classes());
        match big {
            [] => {}
            [k] => out.push(one_bigint(*k, plan.bigint_shared()[0], false)),
            _ if plan.bigint_shared().contains(&true) => out.push(Statement::new(
                Sql::BatchBigint,
                &[
                    Param::Int8Array(big),
                    Param::BoolArray(plan.bigint_shared()),
                ],
            )),
            _ => out.push(Statement::new(
                Sql::BatchBigintExclusive,
                &[Param::Int8Array(big)],
            )),
        }
        if !big.is_empty() && !pair.is_empty() && matches!(self.wait, Wait::Timeout(_)) {
            out.push(Statement::new(Sql::ArmTimeouts, &[]));
        }
        let (objects, shared) = (plan.pair_objects(), plan.pair_shared());
        match pair {
            [] => {}
            [c] => out.push(one_pair(*c, objects[0], shared[0], false)),
            _ if shared.contains(&true) => out.push(Statement::new(
                Sql::BatchPair,
                &[
                    Param::Int4Array(pair),
                    Param::Int4Array(objects),
                    Param::BoolArray(shared),
                ],
            )),
            _ => out.push(Statement::new(
                Sql::BatchPairExclusive,
                &[Param::Int4Array(pair), Param::Int4Array(objects)],
            )),
        }
    }

    /// [`Acquisition::receive`] from what the driver returned: an answer
    /// per statement of the round, in order (a `Vec`, an array, or any
    /// slice of them), each read into its reply by `read` (the adapter's
    /// reading of its driver's rows; see
    /// [`read_reply`](crate::driver::read_reply)), or the first error. An
    /// adapter then keeps only its driver's answers; pairing them with the
    /// round's statements is the engine's. A round of up to two statements
    /// allocates nothing here.
    pub(crate) fn receive_answers<A, S: AsRef<[A]>>(
        &mut self,
        answers: Result<S, DriverError>,
        read: impl Fn(&Statement<'_>, &A) -> Reply,
    ) {
        let answers = match answers {
            Ok(answers) => answers,
            Err(e) => return self.receive(Err(e)),
        };
        let answers = answers.as_ref();
        let Some(round) = self.round() else {
            return;
        };
        let sent = round.kinds();
        let replies: SmallVec<[Reply; 2]> = round
            .iter()
            .zip(answers)
            .map(|(statement, answer)| read(statement, answer))
            .collect();
        self.received(sent.as_slice(), Ok(&replies));
    }

    /// Takes the outcome of the round [`Acquisition::round`] listed: a reply
    /// per statement, in order, or the first error. Decides what comes next.
    pub(crate) fn receive(&mut self, result: Result<Vec<Reply>, DriverError>) {
        let Some(round) = self.round() else {
            return;
        };
        let sent = round.kinds();
        match result {
            Ok(replies) => self.received(sent.as_slice(), Ok(&replies)),
            Err(e) => self.received(sent.as_slice(), Err(e)),
        }
    }

    /// [`Acquisition::receive`], with the kinds of the round's statements.
    fn received(&mut self, sent: &[(Sql, bool)], result: Result<&[Reply], DriverError>) {
        let stage = std::mem::replace(&mut self.stage, Stage::Main);
        self.stage = match (stage, result) {
            (Stage::Main, Ok(replies)) => match self.check(sent, replies) {
                Err(e) => self.cut_off(e),
                // A minting round's token: `check` refuses a minting
                // statement's reply without one.
                Ok(Checked { busy, token, .. }) => {
                    self.token = token;
                    match self.wait {
                        Wait::Try if self.plan.len() > 1 => Stage::Settle(busy),
                        _ if busy.is_empty() => self.settled(Ok(Granted::Now), false),
                        _ => self.settled(Ok(Granted::Busy(busy)), false),
                    }
                }
            },
            (Stage::Main, Err(e)) => match e.into_unexpected() {
                // Not lockkit's statement: nothing is known any more.
                Ok(error) => self.cut_off(error),
                Err(e) => self.main_failed(e),
            },
            (Stage::Settle(busy), Ok(replies)) => match self.check(sent, replies) {
                Err(e) => self.cut_off(e),
                Ok(_) if busy.is_empty() => self.settled(Ok(Granted::Now), false),
                Ok(_) => self.settled(Ok(Granted::Busy(busy)), false),
            },
            (Stage::Settle(_), Err(e)) => self.settled(Err(e.into_error()), true),
            (Stage::Recover(error), Ok(replies)) => match self.check(sent, replies) {
                Err(e) => self.cut_off(e),
                // A slice of the wait ended with the key still busy: the
                // next slice. Only lockkit's own slice (the caller's
                // `lock_timeout` was off), and only a lock timeout: a
                // deadlock, a statement timeout or anything else ends the
                // call.
                Ok(Checked {
                    sliced: Some(true), ..
                }) if error.code() == Some(LOCK_NOT_AVAILABLE) => Stage::Main,
                // Any other failure of a bounded wait ends it as it ends an
                // unbounded one: the transaction aborted, its locks released
                // at once (a deadlock's victim lets the other go).
                Ok(_) if self.sliced => Stage::Abort(error),
                // The savepoint rollback released what the call took and
                // left the transaction usable.
                Ok(_) => {
                    let error = self.own_timeout(error);
                    self.settled(Err(error), false)
                }
            },
            (Stage::Recover(error), Err(_)) => self.settled(Err(error), true),
            // The statement that aborts the transaction failed, as it must.
            (Stage::Abort(error), Err(_)) => self.settled(Err(error), true),
            (Stage::Abort(_), Ok(_)) => self.cut_off(Error::unexpected(
                "lockkit's statement that aborts the transaction succeeded".into(),
            )),
            (finished @ Stage::Finished(_), _) => finished,
        };
    }

    /// The main round failed with the server's or the driver's error.
    fn main_failed(&mut self, e: DriverError) -> Stage {
        let timed = match self.wait {
            Wait::Timeout(t) => Some((t, self.ledger.started.elapsed())),
            _ => None,
        };
        let error = e
            .into_error_in(timed, self.plan.len())
            .with_key_types(self.plan.distinct_types(None));
        let error = match self.mint {
            true => Error::not_installed_or(error, "a fencing token"),
            false => error,
        };
        if self.uses_savepoint() {
            Stage::Recover(error)
        } else {
            // The failed statement aborted the transaction; what the batch
            // took is released with it (or at the rollback).
            self.settled(Err(error), true)
        }
    }

    /// `error`, the main round's, once the call's savepoint was rolled
    /// back: a `25P02` there means the transaction failed after that
    /// savepoint was taken, inside the call. Past a timed call's timeout,
    /// that is the call's own statement_timeout: one that fires as a
    /// statement ends stays pending, and cancels the next message, which
    /// may be one whose reply the driver does not read (diesel-async's
    /// `Close` of a statement it dropped); the call's next statement then
    /// meets `25P02`. The call timed out, holding nothing, its transaction
    /// usable: a [`Timeout`](ErrorKind::Timeout). Any other error stays.
    fn own_timeout(&self, error: Error) -> Error {
        match self.wait {
            Wait::Timeout(timeout) if self.ledger.started.elapsed() >= timeout => {
                error.aborted_as_timeout(timeout, self.plan.len())
            }
            _ => error,
        }
    }

    fn uses_savepoint(&self) -> bool {
        match self.wait {
            Wait::Forever => self.sliced,
            Wait::Timeout(_) => true,
            Wait::Try => self.plan.len() > 1,
        }
    }

    /// Records the outcome in the transaction's bookkeeping.
    fn settled(&mut self, outcome: Result<Granted, Error>, aborted: bool) -> Stage {
        self.ledger.settle(self.plan.taken(), &outcome, aborted);
        Stage::Finished(outcome)
    }

    /// A reply that is not lockkit's: nothing is known any more.
    fn cut_off(&mut self, error: Error) -> Stage {
        Stage::Finished(self.ledger.cut_off(error))
    }

    /// Runs the call: `drive` is the adapter's future that sends its rounds
    /// and finishes it, and runs inside the call's span (entered at each
    /// poll), so that what the driver reports of the statements is nested
    /// under the call.
    // Always inlined: the adapter's future is then built where the lock
    // call keeps it, not returned from here and copied there.
    #[inline(always)]
    pub(crate) fn run<F: std::future::Future>(
        self,
        drive: impl FnOnce(Self) -> F,
    ) -> tracing::instrument::Instrumented<F> {
        use tracing::Instrument as _;
        let span = self.ledger.span.clone();
        drive(self).instrument(span)
    }

    /// Checks every reply of a round against what was sent; returns the busy
    /// keys of a try, the token, and whether a bounded wait was lockkit's
    /// slice.
    fn check(&self, sent: &[(Sql, bool)], replies: &[Reply]) -> Result<Checked, Error> {
        if sent.len() != replies.len() {
            return Err(Error::unexpected(format!(
                "{} replies to {} statements",
                replies.len(),
                sent.len()
            )));
        }
        let mut busy = Vec::new();
        let mut token = None;
        let mut sliced = None;
        for ((sql, minting), reply) in sent.iter().zip(replies) {
            let bad = |what: &str| {
                Err(Error::unexpected(format!(
                    "the reply to lockkit's {sql:?} statement {what}: {reply:?}"
                )))
            };
            let reply = match minted(*minting, reply) {
                Ok((reply, minted)) => {
                    token = minted.or(token);
                    reply
                }
                Err(what) => return bad(what),
            };
            let tag_ok = |tag: &i64| Some(*tag) == sql.tag();
            match (sql.reply(), reply) {
                (ReplyShape::Done, Reply::Done) => {}
                _ if sql.is_one_key() => {
                    if !check_one(*sql, reply)? {
                        busy.extend(self.plan.keys());
                    }
                }
                // Whether the wait was lockkit's slice: 1 or 0, the same in
                // every reply of the call that says it.
                (ReplyShape::Tagged, Reply::Tagged { tag, n })
                    if tag_ok(tag) && matches!(sql, Sql::ArmSlice | Sql::EndSlice) =>
                {
                    let this = match n {
                        0 => false,
                        1 => true,
                        _ => return bad("is neither 0 nor 1"),
                    };
                    if *sliced.get_or_insert(this) != this {
                        return bad("contradicts the slice's arming");
                    }
                }
                (ReplyShape::Tagged, Reply::Tagged { tag, n }) if tag_ok(tag) => {
                    let expected = self.expected_count(*sql);
                    if *n != expected {
                        return bad(&format!("counts {n}, not {expected}"));
                    }
                }
                (ReplyShape::TriedBigint, Reply::TriedBigint { tag, n, busy: b })
                    if tag_ok(tag) =>
                {
                    if *n != self.plan.bigint().len() as i64 {
                        return bad("tried another number of keys");
                    }
                    for k in b {
                        if self.plan.bigint().binary_search(k).is_err() {
                            return bad("names a key that was not requested");
                        }
                        busy.push(LockKey::BigInt(*k));
                    }
                }
                (
                    ReplyShape::TriedPair,
                    Reply::TriedPair {
                        tag,
                        n,
                        classes,
                        objects,
                    },
                ) if tag_ok(tag) => {
                    if *n != self.plan.pair_classes().len() as i64 || classes.len() != objects.len()
                    {
                        return bad("tried another number of keys");
                    }
                    for (c, o) in classes.iter().zip(objects) {
                        let key = LockKey::Pair(*c, *o);
                        if !self.plan.keys().any(|k| k == key) {
                            return bad("names a key that was not requested");
                        }
                        busy.push(key);
                    }
                }
                _ => return bad("is not its reply"),
            }
        }
        Ok(Checked {
            busy,
            token,
            sliced,
        })
    }

    /// How many keys a lock statement must report.
    fn expected_count(&self, sql: Sql) -> i64 {
        let n = match sql {
            Sql::BatchBigint | Sql::BatchBigintExclusive => self.plan.bigint().len(),
            Sql::BatchPair | Sql::BatchPairExclusive => self.plan.pair_classes().len(),
            _ => 0,
        };
        n as i64
    }

    /// The outcome, once [`Acquisition::round`] is `None`: the grant, or the
    /// busy keys of a try. The adapter hands it to [`Grant::lock`] (or
    /// [`Grant::try_lock`], [`Grant::lock_batch`], [`Grant::try_lock_batch`])
    /// for what its lock call returns.
    ///
    /// # Errors
    ///
    /// The error of the call (typed from the driver's error and the call's
    /// timeout); [`ErrorKind::UnexpectedReply`] for a reply that is not
    /// lockkit's; [`ErrorKind::Poisoned`] when called before the outcome is
    /// known (the transaction is then poisoned).
    pub(crate) fn finish(mut self) -> Result<Result<Grant, Busy>, Error> {
        let stage = std::mem::replace(&mut self.stage, Stage::Main);
        let outcome = match stage {
            Stage::Finished(outcome) => outcome,
            _ => {
                // Unfinished: `Drop` poisons the transaction.
                return Err(Error::new(ErrorKind::Poisoned));
            }
        };
        let key = match &self.request.keys {
            Keys::One([(k, m)], _) => Some((*k, self.ledger.state.locks().mode(*k).unwrap_or(*m))),
            Keys::Many(..) => None,
        };
        match outcome {
            Err(e) => Err(e),
            Ok(Granted::Busy(busy)) => {
                let key_types = self.plan.distinct_types(Some(&busy));
                Ok(Err(Busy::new(busy, key_types)))
            }
            Ok(Granted::Now) => Ok(Ok(Grant {
                token: self.token,
                key,
                keys: match std::mem::replace(
                    &mut self.request.keys,
                    Keys::Many(Vec::new(), Vec::new()),
                ) {
                    Keys::Many(v, _) => v,
                    Keys::One(..) => Vec::new(),
                },
            })),
        }
    }
}
