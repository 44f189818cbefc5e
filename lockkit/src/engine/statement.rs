//! The statements the engine asks an adapter to send, and the replies the
//! adapter hands back. These are the only things an adapter interprets.

use std::fmt;

use smallvec::SmallVec;

use crate::engine::sql;
use crate::fencing::FencingToken;

/// One of lockkit's statements. Its text, parameter types and reply shape
/// are fixed; a driver may prepare each once per connection (see
/// [`Sql::PREPARABLE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub(crate) enum Sql {
    /// [`sql::LOCK_BIGINT`].
    LockBigint,
    /// [`sql::LOCK_BIGINT_SHARED`].
    LockBigintShared,
    /// [`sql::LOCK_PAIR`].
    LockPair,
    /// [`sql::LOCK_PAIR_SHARED`].
    LockPairShared,
    /// [`sql::TRY_BIGINT`].
    TryBigint,
    /// [`sql::TRY_BIGINT_SHARED`].
    TryBigintShared,
    /// [`sql::TRY_PAIR`].
    TryPair,
    /// [`sql::TRY_PAIR_SHARED`].
    TryPairShared,
    /// [`sql::BATCH_BIGINT`].
    BatchBigint,
    /// [`sql::BATCH_PAIR`].
    BatchPair,
    /// [`sql::BATCH_BIGINT_EXCLUSIVE`].
    BatchBigintExclusive,
    /// [`sql::BATCH_PAIR_EXCLUSIVE`].
    BatchPairExclusive,
    /// [`sql::TRY_BATCH_BIGINT`].
    TryBatchBigint,
    /// [`sql::TRY_BATCH_PAIR`].
    TryBatchPair,
    /// [`sql::SET_TIMEOUTS`].
    SetTimeouts,
    /// [`sql::ARM_TIMEOUTS`].
    ArmTimeouts,
    /// [`sql::RESTORE_TIMEOUTS`].
    RestoreTimeouts,
    /// [`sql::TRY_PERMIT`].
    TryPermit,
    /// [`sql::ARM_SLICE`].
    ArmSlice,
    /// [`sql::END_SLICE`].
    EndSlice,
    /// [`sql::SAVEPOINT`] (simple protocol).
    Savepoint,
    /// [`sql::RELEASE`] (simple protocol).
    Release,
    /// [`sql::ROLLBACK`] (simple protocol, two statements).
    Rollback,
    /// [`sql::ABORT_TRANSACTION`] (simple protocol; it always fails).
    AbortTransaction,
}

/// A parameter type of lockkit's statements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub(crate) enum ParamType {
    /// `int8`.
    Int8,
    /// `int4`.
    Int4,
    /// `int8[]`.
    Int8Array,
    /// `int4[]`.
    Int4Array,
    /// `bool[]`.
    BoolArray,
}

/// What a statement answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplyShape {
    /// No row: a utility statement sent with the simple query protocol.
    /// Reply: [`Reply::Done`].
    Done,
    /// One row `(tag int8, locked void)`, from a one-key lock, which locks
    /// its key or fails. Reply: [`Reply::Locked`].
    Locked,
    /// One row `(tag int8, n int8)`. Reply: [`Reply::Tagged`].
    Tagged,
    /// One row `(tag int8, n int8, busy int8[])`. Reply:
    /// [`Reply::TriedBigint`].
    TriedBigint,
    /// One row `(tag int8, n int8, busy_class int4[], busy_object int4[])`.
    /// Reply: [`Reply::TriedPair`].
    TriedPair,
}

impl Sql {
    /// Every statement with parameters or a row to answer: those an adapter
    /// may prepare once per connection. The simple-protocol ones
    /// ([`ReplyShape::Done`]) are not among them.
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) const PREPARABLE: [Sql; 20] = [
        Sql::LockBigint,
        Sql::LockBigintShared,
        Sql::LockPair,
        Sql::LockPairShared,
        Sql::TryBigint,
        Sql::TryBigintShared,
        Sql::TryPair,
        Sql::TryPairShared,
        Sql::BatchBigint,
        Sql::BatchPair,
        Sql::BatchBigintExclusive,
        Sql::BatchPairExclusive,
        Sql::TryBatchBigint,
        Sql::TryBatchPair,
        Sql::SetTimeouts,
        Sql::ArmTimeouts,
        Sql::RestoreTimeouts,
        Sql::TryPermit,
        Sql::ArmSlice,
        Sql::EndSlice,
    ];

    /// The SQL text.
    pub(crate) fn text(self) -> &'static str {
        match self {
            Sql::LockBigint => sql::LOCK_BIGINT,
            Sql::LockBigintShared => sql::LOCK_BIGINT_SHARED,
            Sql::LockPair => sql::LOCK_PAIR,
            Sql::LockPairShared => sql::LOCK_PAIR_SHARED,
            Sql::TryBigint => sql::TRY_BIGINT,
            Sql::TryBigintShared => sql::TRY_BIGINT_SHARED,
            Sql::TryPair => sql::TRY_PAIR,
            Sql::TryPairShared => sql::TRY_PAIR_SHARED,
            Sql::BatchBigint => sql::BATCH_BIGINT,
            Sql::BatchPair => sql::BATCH_PAIR,
            Sql::BatchBigintExclusive => sql::BATCH_BIGINT_EXCLUSIVE,
            Sql::BatchPairExclusive => sql::BATCH_PAIR_EXCLUSIVE,
            Sql::TryBatchBigint => sql::TRY_BATCH_BIGINT,
            Sql::TryBatchPair => sql::TRY_BATCH_PAIR,
            Sql::SetTimeouts => sql::SET_TIMEOUTS,
            Sql::ArmTimeouts => sql::ARM_TIMEOUTS,
            Sql::RestoreTimeouts => sql::RESTORE_TIMEOUTS,
            Sql::TryPermit => sql::TRY_PERMIT,
            Sql::ArmSlice => sql::ARM_SLICE,
            Sql::EndSlice => sql::END_SLICE,
            Sql::Savepoint => sql::SAVEPOINT,
            Sql::Release => sql::RELEASE,
            Sql::Rollback => sql::ROLLBACK,
            Sql::AbortTransaction => sql::ABORT_TRANSACTION,
        }
    }

    /// The parameter types, in order.
    pub(crate) fn param_types(self) -> &'static [ParamType] {
        use ParamType::*;
        match self {
            Sql::LockBigint | Sql::LockBigintShared | Sql::TryBigint | Sql::TryBigintShared => {
                &[Int8]
            }
            Sql::LockPair | Sql::LockPairShared | Sql::TryPair | Sql::TryPairShared => {
                &[Int4, Int4]
            }
            Sql::BatchBigint | Sql::TryBatchBigint => &[Int8Array, BoolArray],
            Sql::BatchPair | Sql::TryBatchPair => &[Int4Array, Int4Array, BoolArray],
            Sql::BatchBigintExclusive => &[Int8Array],
            Sql::BatchPairExclusive => &[Int4Array, Int4Array],
            Sql::SetTimeouts => &[Int8],
            Sql::TryPermit => &[Int4, Int4, Int4],
            Sql::ArmTimeouts
            | Sql::RestoreTimeouts
            | Sql::ArmSlice
            | Sql::EndSlice
            | Sql::Savepoint
            | Sql::Release
            | Sql::Rollback
            | Sql::AbortTransaction => &[],
        }
    }

    /// What the statement answers.
    pub(crate) fn reply(self) -> ReplyShape {
        match self {
            Sql::LockBigint | Sql::LockBigintShared | Sql::LockPair | Sql::LockPairShared => {
                ReplyShape::Locked
            }
            Sql::TryBatchBigint => ReplyShape::TriedBigint,
            Sql::TryBatchPair => ReplyShape::TriedPair,
            Sql::Savepoint | Sql::Release | Sql::Rollback | Sql::AbortTransaction => {
                ReplyShape::Done
            }
            _ => ReplyShape::Tagged,
        }
    }

    /// Whether the statement takes keys: a lock, a try, a batch or a
    /// permit's try (not a timeout's setting or a savepoint's statement).
    pub(crate) fn takes_keys(self) -> bool {
        !matches!(
            self,
            Sql::SetTimeouts
                | Sql::ArmTimeouts
                | Sql::RestoreTimeouts
                | Sql::ArmSlice
                | Sql::EndSlice
                | Sql::Savepoint
                | Sql::Release
                | Sql::Rollback
                | Sql::AbortTransaction
        )
    }

    /// Whether the statement takes one key: a lock, or its try.
    pub(crate) fn is_one_key(self) -> bool {
        matches!(
            self,
            Sql::LockBigint
                | Sql::LockBigintShared
                | Sql::LockPair
                | Sql::LockPairShared
                | Sql::TryBigint
                | Sql::TryBigintShared
                | Sql::TryPair
                | Sql::TryPairShared
        )
    }

    /// The statement's text in its minting form ([`sql::minting`]), made
    /// once per process.
    fn minting_text(self) -> &'static str {
        static TEXTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
        let texts = TEXTS.get_or_init(|| {
            Sql::PREPARABLE
                .iter()
                .map(|sql| sql::minting(sql.text()))
                .collect()
        });
        match Sql::PREPARABLE.iter().position(|s| *s == self) {
            Some(i) => &texts[i],
            // A simple-protocol statement answers no row to add a token to.
            None => self.text(),
        }
    }

    /// How many columns the statement's row has, before a minting form's
    /// token.
    fn columns(self) -> usize {
        match self.reply() {
            ReplyShape::Done => 0,
            ReplyShape::Locked | ReplyShape::Tagged => 2,
            ReplyShape::TriedBigint => 3,
            ReplyShape::TriedPair => 4,
        }
    }

    /// The tag the statement's row starts with (`None` for the
    /// simple-protocol ones, which answer no row): the ASCII bytes of
    /// `lockkit` and, in the last byte, the statement's number. A number is
    /// never given to another statement, so a reply is never read as that
    /// of another statement, of this version or of any other.
    pub(crate) const fn tag(self) -> Option<i64> {
        const LOCKKIT: i64 = i64::from_be_bytes(*b"lockkit\0");
        let number = match self {
            Sql::LockBigint => 1,
            Sql::LockBigintShared => 2,
            Sql::LockPair => 3,
            Sql::LockPairShared => 4,
            Sql::TryBigint => 5,
            Sql::TryBigintShared => 6,
            Sql::TryPair => 7,
            Sql::TryPairShared => 8,
            Sql::BatchBigint => 9,
            Sql::BatchPair => 10,
            Sql::BatchBigintExclusive => 11,
            Sql::BatchPairExclusive => 12,
            Sql::TryBatchBigint => 13,
            Sql::TryBatchPair => 14,
            Sql::SetTimeouts => 15,
            Sql::ArmTimeouts => 16,
            Sql::RestoreTimeouts => 17,
            Sql::TryPermit => 18,
            Sql::ArmSlice => 19,
            Sql::EndSlice => 20,
            Sql::Savepoint | Sql::Release | Sql::Rollback | Sql::AbortTransaction => return None,
        };
        Some(LOCKKIT | number)
    }

    /// How many commands the text holds: the number of `CommandComplete`
    /// messages it answers with the simple query protocol (2 for
    /// [`Sql::Rollback`], 1 for the others). For an adapter that sends a
    /// round as one simple-protocol query ([`Statement::write_simple`]) and
    /// must tell which reply belongs to which statement.
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) fn simple_commands(self) -> usize {
        match self {
            Sql::Rollback => 2,
            _ => 1,
        }
    }
}

/// A parameter value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Param<'a> {
    /// `int8`.
    Int8(i64),
    /// `int4`.
    Int4(i32),
    /// `int8[]`.
    Int8Array(&'a [i64]),
    /// `int4[]`.
    Int4Array(&'a [i32]),
    /// `bool[]`.
    BoolArray(&'a [bool]),
}

/// One statement to send: which, and its parameter values (as many as the
/// statement takes, of its types).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Statement<'a> {
    sql: Sql,
    params: [Param<'a>; 3],
    minting: bool,
}

impl<'a> Statement<'a> {
    pub(crate) fn new(sql: Sql, given: &[Param<'a>]) -> Self {
        debug_assert_eq!(given.len(), sql.param_types().len(), "{sql:?}");
        let mut params = [Param::Int8(0); 3];
        params[..given.len()].copy_from_slice(given);
        Statement {
            sql,
            params,
            minting: false,
        }
    }

    /// The statement in its minting form when `mint`: its row ends with a
    /// fencing token's parts, read after it ran ([`sql::minting`]).
    pub(crate) fn minting(self, mint: bool) -> Self {
        debug_assert!(
            !mint || self.sql.reply() != ReplyShape::Done,
            "{:?}",
            self.sql
        );
        Statement {
            minting: mint,
            ..self
        }
    }

    /// Which statement.
    pub(crate) fn sql(&self) -> Sql {
        self.sql
    }

    /// Whether it is in its minting form: its text is not the plain
    /// statement's, so a statement prepared from that text does not serve
    /// it.
    pub fn is_minting(&self) -> bool {
        self.minting
    }

    /// Its text.
    pub fn text(&self) -> &'static str {
        match self.minting {
            false => self.sql.text(),
            true => self.sql.minting_text(),
        }
    }

    /// The parameter values.
    pub fn params(&self) -> &[Param<'a>] {
        &self.params[..self.sql.param_types().len()]
    }

    /// What it answers.
    pub fn reply(&self) -> ReplyShape {
        self.sql.reply()
    }

    /// Appends the statement to `out` for the simple query protocol: its
    /// text with each parameter `$n` replaced by its value as a typed
    /// literal in parentheses (`('42'::int8)`, `('{1,2}'::int4[])`,
    /// `('{t,f}'::bool[])`), so it answers the same row as the statement
    /// sent with bound parameters. The values are integers and booleans
    /// only, so a literal never needs escaping; quoting them keeps the type
    /// exact (`i64::MIN` included, which a bare `-9223372036854775808`
    /// would not parse as).
    ///
    /// For an adapter that sends a whole round, and whatever it prepends,
    /// as one query: one message, no statement to parse by name, and no
    /// unnamed portal left open afterwards (an open portal keeps its
    /// snapshot, and the backend's `backend_xmin`, until the next
    /// statement). Join statements with `;`; each answers one command, the
    /// savepoint's rollback (`ROLLBACK TO` and `RELEASE`) two. Every value
    /// reaches the server as text and comes back as text: the reply checks
    /// are the same ([`read_reply`]).
    pub fn write_simple(&self, out: &mut String) {
        use fmt::Write as _;
        let text = self.text();
        let params = self.params();
        let mut rest = text;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            let (number, next) =
                after.split_at(after.bytes().take_while(u8::is_ascii_digit).count());
            let index: usize = number.parse().unwrap_or(0);
            match index.checked_sub(1).and_then(|i| params.get(i)) {
                Some(param) => {
                    out.push_str("('");
                    let _ = match param {
                        Param::Int8(v) => write!(out, "{v}'::int8"),
                        Param::Int4(v) => write!(out, "{v}'::int4"),
                        Param::Int8Array(vs) => write_array(out, vs, "int8"),
                        Param::Int4Array(vs) => write_array(out, vs, "int4"),
                        Param::BoolArray(vs) => {
                            let bits: Vec<char> =
                                vs.iter().map(|b| if *b { 't' } else { 'f' }).collect();
                            write_array(out, &bits, "bool")
                        }
                    };
                    out.push(')');
                }
                // Not a parameter of this statement (no text of lockkit's
                // has one): left as it is, so the server rejects it.
                None => {
                    out.push('$');
                    out.push_str(number);
                }
            }
            rest = next;
        }
        out.push_str(rest);
    }
}

/// `{a,b,…}'::ty[]`: the rest of an array literal after its opening quote.
fn write_array<T: fmt::Display>(out: &mut String, values: &[T], ty: &str) -> fmt::Result {
    use fmt::Write as _;
    out.push('{');
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write!(out, "{v}")?;
    }
    write!(out, "}}'::{ty}[]")
}

impl fmt::Debug for Statement<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Statement")
            .field("sql", &self.sql)
            .field("params", &self.params())
            .field("minting", &self.minting)
            .finish()
    }
}

/// The statements of one round, in the order to send them: at most
/// [`Round::MAX`], kept inline (a lock call allocates nothing for them).
/// Dereferences to a slice.
#[derive(Clone)]
pub struct Round<'a> {
    statements: [Statement<'a>; Round::MAX],
    len: usize,
}

impl<'a> Round<'a> {
    /// The most statements a round has (a timed batch over both key spaces:
    /// savepoint, set timeouts, two lock statements, re-arm, restore,
    /// release).
    pub const MAX: usize = 8;

    pub(crate) fn new() -> Self {
        Round {
            statements: [Statement::new(Sql::Release, &[]); Round::MAX],
            len: 0,
        }
    }

    pub(crate) fn push(&mut self, statement: Statement<'a>) {
        self.statements[self.len] = statement;
        self.len += 1;
    }

    /// The kind of each statement, in order, and whether it is in its
    /// minting form.
    pub(crate) fn kinds(&self) -> SmallVec<[(Sql, bool); Round::MAX]> {
        self.iter().map(|s| (s.sql, s.minting)).collect()
    }

    /// Puts the round's last statement that takes keys in its minting form
    /// when `mint`: its token is read after every lock of the round.
    pub(crate) fn mint_last_take(&mut self, mint: bool) {
        if !mint {
            return;
        }
        let takes = self.statements[..self.len]
            .iter()
            .rposition(|s| s.sql.takes_keys());
        if let Some(i) = takes {
            self.statements[i].minting = true;
        }
    }
}

impl<'a> std::ops::Deref for Round<'a> {
    type Target = [Statement<'a>];
    fn deref(&self) -> &[Statement<'a>] {
        &self.statements[..self.len]
    }
}

impl<'r, 'a> IntoIterator for &'r Round<'a> {
    type Item = &'r Statement<'a>;
    type IntoIter = std::slice::Iter<'r, Statement<'a>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl fmt::Debug for Round<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// What an adapter got back for one statement, in the shape of
/// [`Statement::reply`]. The engine checks every one.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// A simple-protocol statement completed.
    Done,
    /// The row of a [`ReplyShape::Locked`] statement.
    Locked {
        /// Column `tag`.
        tag: i64,
    },
    /// The row of a [`ReplyShape::Tagged`] statement.
    Tagged {
        /// Column `tag`.
        tag: i64,
        /// Column `n`.
        n: i64,
    },
    /// The row of a [`ReplyShape::TriedBigint`] statement.
    TriedBigint {
        /// Column `tag`.
        tag: i64,
        /// Column `n`: keys tried.
        n: i64,
        /// Column `busy`.
        busy: Vec<i64>,
    },
    /// The row of a [`ReplyShape::TriedPair`] statement.
    TriedPair {
        /// Column `tag`.
        tag: i64,
        /// Column `n`: keys tried.
        n: i64,
        /// Column `busy_class`.
        classes: Vec<i32>,
        /// Column `busy_object`.
        objects: Vec<i32>,
    },
    /// Anything else: no row, several rows, other columns or types. The text
    /// says what was seen.
    Malformed(String),
    /// The row of a statement in its minting form: the statement's own
    /// reply, then the token's parts (`timeline`, `flush`, `counter`).
    Minted {
        /// The statement's own reply.
        reply: Box<Reply>,
        /// Columns `timeline`, `flush` and `counter`.
        token: [i64; 3],
    },
}

/// One row as a driver returned it, read by column index: what an adapter
/// implements (a few lines over its driver's row type) so that the engine,
/// not each adapter, knows the column layout of lockkit's replies and of
/// [`SERVER_FACTS`](crate::driver::sql::SERVER_FACTS).
pub trait ReplyRow {
    /// The driver's decoding error, kept as text in [`Reply::Malformed`].
    type Error: fmt::Display;
    /// Column `i` as `int8`.
    fn int8(&self, i: usize) -> Result<i64, Self::Error>;
    /// Column `i` as `int4`.
    fn int4(&self, i: usize) -> Result<i32, Self::Error>;
    /// Column `i` as `bool`.
    fn bool(&self, i: usize) -> Result<bool, Self::Error>;
    /// Column `i` as `int8[]`.
    fn int8_array(&self, i: usize) -> Result<Vec<i64>, Self::Error>;
    /// Column `i` as `int4[]`.
    fn int4_array(&self, i: usize) -> Result<Vec<i32>, Self::Error>;
}

/// The statement's own reply within `reply`, and the fencing token it
/// carries when the statement was sent `minting` ([`Reply::Minted`]).
///
/// # Errors
///
/// What is wrong with the reply: a minting statement's reply without a
/// token, or with one out of range; a token where none was asked.
pub(crate) fn minted(
    minting: bool,
    reply: &Reply,
) -> Result<(&Reply, Option<FencingToken>), &'static str> {
    match (minting, reply) {
        (true, Reply::Minted { reply, token }) => match FencingToken::from_columns(*token) {
            Some(token) => Ok((reply, Some(token))),
            None => Err("has a fencing token out of range"),
        },
        (true, _) => Err("has no fencing token"),
        (false, Reply::Minted { .. }) => Err("has a fencing token nobody asked for"),
        (false, reply) => Ok((reply, None)),
    }
}

/// The reply to `statement` from the rows a driver returned for it (`None`
/// for a simple-protocol statement that returns none): exactly one row, in
/// the statement's [`ReplyShape`], else [`Reply::Malformed`].
pub fn read_reply<R: ReplyRow>(statement: &Statement<'_>, rows: Option<&[R]>) -> Reply {
    let rows = match (statement.reply(), rows) {
        (ReplyShape::Done, None) => return Reply::Done,
        (_, Some(rows)) => rows,
        (_, None) => return Reply::Malformed("no rows".into()),
    };
    let [row] = rows else {
        return Reply::Malformed(format!("{} rows", rows.len()));
    };
    let read = || -> Result<Reply, R::Error> {
        Ok(match statement.reply() {
            ReplyShape::Locked => Reply::Locked { tag: row.int8(0)? },
            ReplyShape::Tagged => Reply::Tagged {
                tag: row.int8(0)?,
                n: row.int8(1)?,
            },
            ReplyShape::TriedBigint => Reply::TriedBigint {
                tag: row.int8(0)?,
                n: row.int8(1)?,
                busy: row.int8_array(2)?,
            },
            ReplyShape::TriedPair => Reply::TriedPair {
                tag: row.int8(0)?,
                n: row.int8(1)?,
                classes: row.int4_array(2)?,
                objects: row.int4_array(3)?,
            },
            ReplyShape::Done => Reply::Malformed("a row".into()),
        })
    };
    let reply = read().and_then(|reply| match statement.is_minting() {
        false => Ok(reply),
        true => {
            let at = statement.sql().columns();
            let token = [row.int8(at)?, row.int8(at + 1)?, row.int8(at + 2)?];
            Ok(Reply::Minted {
                reply: Box::new(reply),
                token,
            })
        }
    });
    reply.unwrap_or_else(|e| Reply::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn simple(sql: Sql, params: &[Param<'_>]) -> String {
        let mut out = String::new();
        Statement::new(sql, params).write_simple(&mut out);
        out
    }

    #[test]
    fn simple_text_has_typed_literals() {
        assert_eq!(
            simple(Sql::LockBigint, &[Param::Int8(i64::MIN)]),
            "/* lockkit:lock_bigint */ SELECT 7813573191525823489::int8 AS tag, \
             pg_advisory_xact_lock(('-9223372036854775808'::int8)) AS locked"
        );
        assert_eq!(
            simple(
                Sql::TryPairShared,
                &[Param::Int4(-1), Param::Int4(i32::MAX)]
            ),
            "/* lockkit:try_pair_shared */ SELECT 7813573191525823496::int8 AS tag, \
             pg_try_advisory_xact_lock_shared(('-1'::int4), ('2147483647'::int4))::int::int8 AS n"
        );
        let pairs = simple(
            Sql::BatchPair,
            &[
                Param::Int4Array(&[1, -2]),
                Param::Int4Array(&[3, 4]),
                Param::BoolArray(&[true, false]),
            ],
        );
        assert!(
            pairs.contains(
                "unnest(('{1,-2}'::int4[])::int4[]) AS c, unnest(('{3,4}'::int4[])::int4[]) AS o, \
                 unnest(('{t,f}'::bool[])::bool[]) AS s"
            ),
            "{pairs}"
        );
        assert!(
            simple(Sql::BatchBigintExclusive, &[Param::Int8Array(&[])]).contains("('{}'::int8[])")
        );
        // Ten-plus milliseconds: `$1` is replaced whole (and `$10` would
        // not be read as `$1` followed by a zero).
        let timeouts = simple(Sql::SetTimeouts, &[Param::Int8(1500)]);
        assert_eq!(timeouts.matches("('1500'::int8)").count(), 1, "{timeouts}");
        assert!(!timeouts.contains('$'), "{timeouts}");
        // Texts without parameters are sent as they are.
        assert_eq!(simple(Sql::Rollback, &[]), sql::ROLLBACK);
        assert_eq!(simple(Sql::RestoreTimeouts, &[]), sql::RESTORE_TIMEOUTS);
    }

    #[test]
    fn every_parameter_of_every_statement_is_replaced() {
        for sql in Sql::PREPARABLE {
            let params: Vec<Param<'_>> = sql
                .param_types()
                .iter()
                .map(|t| match t {
                    ParamType::Int8 => Param::Int8(7),
                    ParamType::Int4 => Param::Int4(7),
                    ParamType::Int8Array => Param::Int8Array(&[7]),
                    ParamType::Int4Array => Param::Int4Array(&[7]),
                    ParamType::BoolArray => Param::BoolArray(&[false]),
                })
                .collect();
            let text = simple(sql, &params);
            assert!(!text.contains('$'), "{sql:?}: {text}");
            assert_eq!(
                text.matches('(').count(),
                text.matches(')').count(),
                "{text}"
            );
        }
    }

    /// Each statement's row starts with its own tag, which its text names:
    /// a reply is never read as another statement's. The timeouts' arming
    /// and restoring statements answer it only when the saving statement
    /// ran in the transaction.
    #[test]
    fn every_row_starts_with_the_statements_own_tag() {
        let mut tags = std::collections::HashSet::new();
        for sql in Sql::PREPARABLE {
            let tag = sql.tag().expect("a statement that answers a row has a tag");
            assert_eq!(tag.to_be_bytes()[..7], *b"lockkit", "{sql:?}");
            assert!(tags.insert(tag), "{sql:?}: tag {tag} given twice");
            let text = sql.text();
            assert!(text.starts_with("/* lockkit:"), "{sql:?}: {text}");
            // The tag first; a statement that checks its transaction's
            // state answers it only when that state is there.
            assert!(
                text.contains(&format!("*/ SELECT {tag}::int8 AS tag, "))
                    || text.contains(&format!(" THEN {tag}::int8 END AS tag, ")),
                "{sql:?}: {text}"
            );
        }
        for sql in [Sql::Savepoint, Sql::Release, Sql::Rollback] {
            assert_eq!(sql.tag(), None);
        }
        assert_eq!(Sql::LockBigint.tag(), Some(7813573191525823489));
    }

    #[test]
    fn commands_per_text() {
        for sql in Sql::PREPARABLE {
            assert_eq!(sql.simple_commands(), 1, "{sql:?}");
        }
        assert_eq!(Sql::Savepoint.simple_commands(), 1);
        assert_eq!(Sql::Release.simple_commands(), 1);
        assert_eq!(
            Sql::Rollback.simple_commands(),
            sql::ROLLBACK.split(';').count()
        );
    }

    /// `Sql::index` is dense and distinct: an adapter's statement cache
    /// keeps one slot per statement.
    /// A one-key lock answers its tag alone, a try-batch its busy keys, a
    /// simple-protocol statement no row, and every other statement its tag
    /// and count.
    #[test]
    fn each_statement_answers_in_its_shape() {
        for sql in Sql::PREPARABLE {
            let expected = match sql {
                Sql::LockBigint | Sql::LockBigintShared | Sql::LockPair | Sql::LockPairShared => {
                    ReplyShape::Locked
                }
                Sql::TryBatchBigint => ReplyShape::TriedBigint,
                Sql::TryBatchPair => ReplyShape::TriedPair,
                _ => ReplyShape::Tagged,
            };
            assert_eq!(sql.reply(), expected, "{sql:?}");
        }
        for sql in [Sql::Savepoint, Sql::Release, Sql::Rollback] {
            assert_eq!(sql.reply(), ReplyShape::Done, "{sql:?}");
        }
    }

    /// A round iterates over, and shows, the statements pushed on it, in
    /// order.
    #[test]
    fn a_round_is_its_statements_in_order() {
        let mut round = Round::new();
        round.push(Statement::new(Sql::Savepoint, &[]));
        round.push(Statement::new(Sql::Release, &[]));
        let kinds: Vec<Sql> = (&round).into_iter().map(|s| s.sql()).collect();
        assert_eq!(kinds, [Sql::Savepoint, Sql::Release]);
        assert_eq!(
            round.kinds().as_slice(),
            [(Sql::Savepoint, false), (Sql::Release, false)]
        );
        assert_eq!(format!("{round:?}").matches("Statement").count(), 2);
    }

    /// Minting puts the round's last statement that takes keys in its
    /// minting form, and no other: not a timeout's or a savepoint's.
    #[test]
    fn a_round_mints_in_its_last_take() {
        let take = Statement::new(Sql::LockBigint, &[Param::Int8(1)]);
        let batch = Statement::new(
            Sql::BatchPairExclusive,
            &[Param::Int4Array(&[1]), Param::Int4Array(&[2])],
        );
        let mut round = Round::new();
        for statement in [
            Statement::new(Sql::Savepoint, &[]),
            take,
            batch,
            Statement::new(Sql::RestoreTimeouts, &[]),
            Statement::new(Sql::Release, &[]),
        ] {
            round.push(statement);
        }
        let mut plain = round.clone();
        plain.mint_last_take(false);
        assert!(plain.iter().all(|s| !s.is_minting()));
        round.mint_last_take(true);
        let minting: Vec<bool> = round.iter().map(Statement::is_minting).collect();
        assert_eq!(minting, [false, false, true, false, false]);
        assert_eq!(round[2].text(), sql::minting(sql::BATCH_PAIR_EXCLUSIVE));
        assert_eq!(round[1].text(), sql::LOCK_BIGINT);
    }

    /// A minting statement's reply is its own row, then the token's parts
    /// after its columns; a plain one's has none.
    #[test]
    fn a_minting_reply_reads_the_token_after_the_statements_columns() {
        struct Row(Vec<i64>);
        impl ReplyRow for Row {
            type Error = String;
            fn int8(&self, i: usize) -> Result<i64, String> {
                self.0
                    .get(i)
                    .copied()
                    .ok_or_else(|| format!("no column {i}"))
            }
            fn int4(&self, _: usize) -> Result<i32, String> {
                Err("int4".into())
            }
            fn bool(&self, _: usize) -> Result<bool, String> {
                Err("bool".into())
            }
            fn int8_array(&self, _: usize) -> Result<Vec<i64>, String> {
                Ok(vec![])
            }
            fn int4_array(&self, _: usize) -> Result<Vec<i32>, String> {
                Ok(vec![])
            }
        }
        let tag = Sql::TryBigint.tag().unwrap();
        let statement = Statement::new(Sql::TryBigint, &[Param::Int8(1)]);
        let row = [Row(vec![tag, 1, 1, 50, 7])];
        assert_eq!(
            read_reply(&statement, Some(&row)),
            Reply::Tagged { tag, n: 1 }
        );
        assert_eq!(
            read_reply(&statement.minting(true), Some(&row)),
            Reply::Minted {
                reply: Box::new(Reply::Tagged { tag, n: 1 }),
                token: [1, 50, 7]
            }
        );
        let short = [Row(vec![tag, 1, 1])];
        assert!(matches!(
            read_reply(&statement.minting(true), Some(&short)),
            Reply::Malformed(_)
        ));
        // A tried batch has three columns of its own before the token.
        let tag = Sql::TryBatchBigint.tag().unwrap();
        let statement = Statement::new(
            Sql::TryBatchBigint,
            &[Param::Int8Array(&[1]), Param::BoolArray(&[false])],
        );
        let row = [Row(vec![tag, 1, 0, 2, 60, 8])];
        assert_eq!(
            read_reply(&statement.minting(true), Some(&row)),
            Reply::Minted {
                reply: Box::new(Reply::TriedBigint {
                    tag,
                    n: 1,
                    busy: vec![]
                }),
                token: [2, 60, 8]
            }
        );
        assert_eq!(
            minted(true, &read_reply(&statement.minting(true), Some(&row)))
                .unwrap()
                .1,
            FencingToken::from_parts(2, 60, 8)
        );
        assert!(minted(true, &Reply::Done).is_err());
        assert!(minted(
            false,
            &Reply::Minted {
                reply: Box::new(Reply::Done),
                token: [1, 1, 1]
            }
        )
        .is_err());
        assert!(minted(
            true,
            &Reply::Minted {
                reply: Box::new(Reply::Done),
                token: [-1, 1, 1]
            }
        )
        .is_err());
    }

    /// A round's `Debug` lists its statements.
    #[test]
    fn a_round_shows_its_statements() {
        let mut round = Round::new();
        round.push(Statement::new(Sql::Savepoint, &[]));
        round.push(Statement::new(Sql::Release, &[]));
        let shown = format!("{round:?}");
        assert!(
            shown.contains("Savepoint") && shown.contains("Release"),
            "{shown}"
        );
    }
}
