//! Turns IDL text into tokens, each with its 1-based line and column.

use crate::{Fail, Span};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tok {
    Ident(String),
    /// An unsigned integer literal (a leading `-` is its own token).
    Int(u64),
    Str(String),
    /// One of `{ } ( ) [ ] ; : , . -` or `->`.
    Punct(&'static str),
    Eof,
}

impl Tok {
    /// How a token reads in an error message.
    pub(crate) fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("`{s}`"),
            Tok::Int(n) => format!("`{n}`"),
            Tok::Str(s) => format!("{s:?}"),
            Tok::Punct(p) => format!("`{p}`"),
            Tok::Eof => "end of file".to_string(),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Token {
    pub tok: Tok,
    pub span: Span,
}

const PUNCTS: &[&str] = &["->", "{", "}", "(", ")", "[", "]", ";", ":", ",", ".", "-"];

pub(crate) fn lex(text: &str) -> Result<Vec<Token>, Fail> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let (mut i, mut line, mut col) = (0usize, 1usize, 1usize);
    while i < chars.len() {
        let c = chars[i];
        let span = Span { line, col };
        // Advances over `n` characters that contain no newline.
        let step = |i: &mut usize, col: &mut usize, n: usize| {
            *i += n;
            *col += n;
        };
        if c == '\n' {
            i += 1;
            line += 1;
            col = 1;
        } else if c.is_whitespace() {
            step(&mut i, &mut col, 1);
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                step(&mut i, &mut col, 1);
            }
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                step(&mut i, &mut col, 1);
            }
            out.push(Token {
                tok: Tok::Ident(chars[start..i].iter().collect()),
                span,
            });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                step(&mut i, &mut col, 1);
            }
            let word: String = chars[start..i].iter().filter(|&&c| c != '_').collect();
            let value = match word.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => word.parse::<u64>(),
            };
            match value {
                Ok(n) => out.push(Token {
                    tok: Tok::Int(n),
                    span,
                }),
                Err(_) => return Err(Fail::new(span, format!("invalid integer literal `{word}`"))),
            }
        } else if c == '"' {
            step(&mut i, &mut col, 1);
            let mut s = String::new();
            loop {
                match chars.get(i) {
                    None | Some('\n') => {
                        return Err(Fail::new(span, "unterminated string literal"))
                    }
                    Some('"') => {
                        step(&mut i, &mut col, 1);
                        break;
                    }
                    Some('\\') => {
                        let at = Span { line, col };
                        match chars.get(i + 1) {
                            Some('\\') => s.push('\\'),
                            Some('"') => s.push('"'),
                            Some('n') => s.push('\n'),
                            _ => {
                                return Err(Fail::new(
                                    at,
                                    "unknown escape in string literal; expected \\\\, \\\" or \\n",
                                ))
                            }
                        }
                        step(&mut i, &mut col, 2);
                    }
                    Some(&c) => {
                        s.push(c);
                        step(&mut i, &mut col, 1);
                    }
                }
            }
            out.push(Token {
                tok: Tok::Str(s),
                span,
            });
        } else {
            let rest = &chars[i..];
            let punct = PUNCTS
                .iter()
                .find(|p| p.chars().zip(rest).filter(|(a, b)| a == *b).count() == p.len());
            match punct {
                Some(p) => {
                    step(&mut i, &mut col, p.len());
                    out.push(Token {
                        tok: Tok::Punct(p),
                        span,
                    });
                }
                None => return Err(Fail::new(span, format!("unexpected character {c:?}"))),
            }
        }
    }
    out.push(Token {
        tok: Tok::Eof,
        span: Span { line, col },
    });
    Ok(out)
}
