//! `kintsugi bench --json …`: the same benchmark, its tables as JSON lines.
//! The markdown tables are every benchmark's one output, so this runs the
//! benchmark as a child (this binary, the same arguments without `--json`)
//! and turns each table on its stdout into one JSON object:
//! `{"title": …, "columns": [...], "rows": [{column: cell, …}, …]}`, the
//! title being the last line above the table (its heading, or the
//! benchmark's first line), a cell a number where it reads
//! as one (a plain decimal, or one ending in ` %` or `×`) and text
//! otherwise. What is not a table (headings, notes) goes to stderr.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};

/// Runs this binary with `args` (which hold no `--json`), converting its
/// stdout; returns whether it succeeded.
pub fn run(args: &[String]) -> anyhow::Result<bool> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let mut tables = Tables::default();
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(t) = tables.line(&line) {
            writeln!(out, "{t}")?;
        }
    }
    if let Some(t) = tables.end() {
        writeln!(out, "{t}")?;
    }
    Ok(child.wait()?.success())
}

/// Markdown tables read line by line.
#[derive(Default)]
struct Tables {
    title: String,
    columns: Vec<String>,
    rows: Vec<Value>,
    /// Inside a table (its head read).
    open: bool,
}

impl Tables {
    /// Takes one line; returns a table it ended, as JSON.
    fn line(&mut self, line: &str) -> Option<Value> {
        let Some(cells) = cells(line) else {
            let ended = self.end();
            if !line.trim().is_empty() {
                self.title = line.trim_start_matches('#').trim().to_string();
                eprintln!("{line}");
            }
            return ended;
        };
        if !self.open {
            self.columns = cells.iter().map(|c| c.to_string()).collect();
            self.open = true;
        } else if !cells
            .iter()
            .all(|c| c.starts_with("--") || c.starts_with(":-"))
        {
            let row: Map<String, Value> = self
                .columns
                .iter()
                .cloned()
                .zip(cells.iter().map(|c| cell(c)))
                .collect();
            self.rows.push(Value::Object(row));
        }
        None
    }

    /// Ends the table being read, if one is.
    fn end(&mut self) -> Option<Value> {
        if !std::mem::take(&mut self.open) {
            return None;
        }
        Some(json!({
            "title": self.title,
            "columns": std::mem::take(&mut self.columns),
            "rows": std::mem::take(&mut self.rows),
        }))
    }
}

/// The cells of a table line `| a | b |`, if it is one.
fn cells(line: &str) -> Option<Vec<&str>> {
    let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
    Some(inner.split('|').map(str::trim).collect())
}

/// A cell as a number where it reads as one, else as text.
fn cell(c: &str) -> Value {
    let bare = c
        .trim_end_matches('%')
        .trim_end_matches('×')
        .trim()
        .trim_matches('*');
    match bare.parse::<f64>() {
        Ok(v) if v.is_finite() => json!(v),
        _ => json!(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_markdown_table_becomes_one_object_under_its_heading() {
        let mut t = Tables::default();
        let text = "## bench\n\n### Throughput (n = 3)\n\n| server | req/s | × nginx |\n| --- | ---: | ---: |\n| nginx | 13077 | 1.000 |\n| kintsugi | 2944 | 0.23 × |\n\nnote\n";
        let mut out: Vec<Value> = text.lines().filter_map(|l| t.line(l)).collect();
        out.extend(t.end());
        assert_eq!(out.len(), 1);
        assert_eq!(out[0]["title"], "Throughput (n = 3)");
        assert_eq!(out[0]["columns"], json!(["server", "req/s", "× nginx"]));
        assert_eq!(out[0]["rows"][1]["req/s"], json!(2944.0));
        assert_eq!(out[0]["rows"][1]["× nginx"], json!(0.23));
        assert_eq!(out[0]["rows"][0]["server"], "nginx");
    }
}
