//! A row of the simple query protocol, every value as text, read as the
//! engine reads a reply ([`ReplyRow`]): the rows of session locks' simple
//! queries, and of the lock statements tokio-postgres sends in the default
//! statement mode.

use std::fmt;

use crate::engine::ReplyRow;

/// A simple-protocol row: every column as text, decoded here for the
/// engine's reply checks (and the set-up row).
pub(crate) struct SimpleRow(pub(crate) tokio_postgres::SimpleQueryRow);

/// Why a [`SimpleRow`] column could not be read.
pub(crate) struct BadColumn(pub(crate) String);

impl fmt::Display for BadColumn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl SimpleRow {
    /// Column `i`'s text.
    pub(crate) fn text(&self, i: usize) -> Result<&str, BadColumn> {
        match self.0.try_get(i) {
            Ok(Some(text)) => Ok(text),
            Ok(None) => Err(BadColumn(format!("column {i} is NULL"))),
            Err(e) => Err(BadColumn(e.to_string())),
        }
    }

    fn parse<T: std::str::FromStr>(&self, i: usize, ty: &str) -> Result<T, BadColumn> {
        let text = self.text(i)?;
        text.parse()
            .map_err(|_| BadColumn(format!("column {i}: {text:?} is not {ty}")))
    }

    fn array<T: std::str::FromStr>(&self, i: usize, ty: &str) -> Result<Vec<T>, BadColumn> {
        let text = self.text(i)?;
        let bad = || BadColumn(format!("column {i}: {text:?} is not {ty}[]"));
        let inner = text
            .strip_prefix('{')
            .and_then(|t| t.strip_suffix('}'))
            .ok_or_else(bad)?;
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        inner
            .split(',')
            .map(|v| v.parse().map_err(|_| bad()))
            .collect()
    }
}

impl ReplyRow for SimpleRow {
    type Error = BadColumn;
    fn int8(&self, i: usize) -> Result<i64, BadColumn> {
        self.parse(i, "int8")
    }
    fn int4(&self, i: usize) -> Result<i32, BadColumn> {
        self.parse(i, "int4")
    }
    fn bool(&self, i: usize) -> Result<bool, BadColumn> {
        match self.text(i)? {
            "t" => Ok(true),
            "f" => Ok(false),
            text => Err(BadColumn(format!("column {i}: {text:?} is not bool"))),
        }
    }
    fn int8_array(&self, i: usize) -> Result<Vec<i64>, BadColumn> {
        self.array(i, "int8")
    }
    fn int4_array(&self, i: usize) -> Result<Vec<i32>, BadColumn> {
        self.array(i, "int4")
    }
}
