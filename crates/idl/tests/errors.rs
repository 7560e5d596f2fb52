//! Every kind of lexical, syntax and semantic error, with its exact position.

use std::path::Path;

/// Line 1 and 2 of every case; the case itself starts on line 3.
const HEAD: &str = "interface t;\nerrors { NotFound, Exists }\n";

fn err(body: &str) -> String {
    let text = format!("{HEAD}{body}");
    match kintsugi_idl::parse(Path::new("t.kidl"), &text) {
        Ok(_) => panic!("parsed without error:\n{text}"),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn expect(body: &str, want: &str) {
    assert_eq!(err(body), want);
}

const DESC: &str = "descriptor D { field pos: u64; }\n"; // line 3
const MAKE: &str = "fn mk(tag: u64 remember) -> D create;\n"; // line 4

// Lexical.

#[test]
fn unexpected_character() {
    expect("fn f(a: u32) @;", "t.kidl:3:14: unexpected character '@'");
}

#[test]
fn unterminated_string() {
    expect(
        r#"fn f(s: str replay("abc) -> D create;"#,
        "t.kidl:3:20: unterminated string literal",
    );
}

#[test]
fn unknown_escape() {
    expect(
        r#"fn f(s: str replay("a\q"));"#,
        r#"t.kidl:3:22: unknown escape in string literal; expected \\, \" or \n"#,
    );
}

#[test]
fn integer_too_large() {
    expect(
        "fn f(a: u64 range(0, 99999999999999999999));",
        "t.kidl:3:22: invalid integer literal `99999999999999999999`",
    );
}

// Syntax.

#[test]
fn missing_interface_line() {
    let e = kintsugi_idl::parse(Path::new("t.kidl"), "\n  fn f();").unwrap_err();
    assert_eq!(
        e.to_string(),
        "t.kidl:2:3: expected `interface NAME;` first, found `fn`"
    );
    assert_eq!((e.line, e.col), (2, 3));
}

#[test]
fn missing_semicolon_at_end_of_file() {
    expect(
        "fn f(a: u32) -> u32\n",
        "t.kidl:4:1: expected an annotation or `;`, found end of file",
    );
}

#[test]
fn expected_punctuation() {
    expect("fn f(a u32);", "t.kidl:3:8: expected `:`, found `u32`");
}

#[test]
fn unknown_item() {
    expect(
        "struct X {}",
        "t.kidl:3:1: expected `errors`, `record`, `descriptor` or `fn`, found `struct`",
    );
}

#[test]
fn expected_type() {
    expect("fn f(a: 5);", "t.kidl:3:9: expected a type, found `5`");
}

#[test]
fn lists_nest_too_deeply() {
    expect(
        "fn f() -> [[[[[[[[[u8]]]]]]]]];",
        "t.kidl:3:19: lists nest too deeply (at most 8 levels)",
    );
}

#[test]
fn second_errors_block() {
    expect(
        "errors { Gone }",
        "t.kidl:3:1: a second `errors` block; list all errors in one",
    );
}

#[test]
fn unknown_argument_annotation() {
    expect(
        "fn f(path: str rememebr);",
        "t.kidl:3:16: unknown annotation `rememebr`; expected one of remember, replay, range, max, set, parent, from",
    );
}

#[test]
fn unknown_function_annotation() {
    expect(
        "fn f() creat;",
        "t.kidl:3:8: unknown annotation `creat`; expected one of create, terminal, advance, at_most, above, restore, retry_ok, fails, infallible, store, named_by, block, wakeup, transition, readonly",
    );
}

#[test]
fn argument_annotation_on_function() {
    expect(
        "fn f() remember;",
        "t.kidl:3:8: unknown annotation `remember`; expected one of create, terminal, advance, at_most, above, restore, retry_ok, fails, infallible, store, named_by, block, wakeup, transition, readonly \
         (argument annotations go right after the argument's type)",
    );
}

#[test]
fn duplicate_annotation() {
    expect(
        "fn f(a: u32 range(0, 1) range(0, 2));",
        "t.kidl:3:25: duplicate annotation `range`",
    );
}

#[test]
fn annotation_arity() {
    expect(
        "fn f(a: u32 range(1));",
        "t.kidl:3:19: `range` takes 2 arguments (lo, hi), found 1",
    );
    expect(
        "fn f(a: u32 remember(1));",
        "t.kidl:3:22: `remember` takes no arguments",
    );
}

#[test]
fn annotation_value_kind() {
    expect(
        "fn f(a: str max(x));",
        "t.kidl:3:17: `max` expects integers, found `x`",
    );
    expect(
        "fn f(a: u64 set(pos));",
        "t.kidl:3:17: `set` expects `descriptor_arg.field`, found `pos`",
    );
    expect(
        "fn f(a: u64 replay(d.x));",
        "t.kidl:3:20: `replay` expects a literal (integer, true, false or string), found `d.x`",
    );
}

#[test]
fn empty_range() {
    expect(
        "fn f(a: u32 range(5, 1));",
        "t.kidl:3:19: empty range: 5 is greater than 1",
    );
}

#[test]
fn unknown_descriptor_property() {
    expect(
        "descriptor D { namspace: local; }",
        "t.kidl:3:16: unknown descriptor property `namspace`; expected one of namespace, close, parent, reboot, field, states, unknown",
    );
}

#[test]
fn unknown_names_a_declared_error_of_a_local_descriptor() {
    expect(
        "descriptor D { unknown: Gone; }",
        "t.kidl:3:25: `unknown: Gone`: unknown error `Gone`; declared: NotFound, Exists",
    );
    expect(
        "descriptor D { namespace: global; unknown: NotFound; }",
        "t.kidl:3:44: `D`: `unknown` is for local descriptors (the server stub refuses a global descriptor it does not know)",
    );
}

#[test]
fn unknown_property_value() {
    expect(
        "descriptor D { namespace: locl; }",
        "t.kidl:3:27: unknown namespace `locl`; expected local or global",
    );
    expect(
        "descriptor D { close: all; }",
        "t.kidl:3:23: unknown close `all`; expected self or subtree",
    );
}

#[test]
fn duplicate_property() {
    expect(
        "descriptor D {\n  close: self;\n  close: subtree;\n}",
        "t.kidl:5:3: `close` is already set for `D`",
    );
}

#[test]
fn parent_rules() {
    expect(
        "descriptor D { namespace: global; parent: same; }",
        "t.kidl:3:12: `D` has a parent, so it must declare `close: subtree` (closing a descriptor removes its children)",
    );
    expect(
        "descriptor D { parent: other(fs); }",
        "t.kidl:3:24: unknown parent `other`; expected none or same",
    );
    expect(
        "descriptor D { field pos: u32; }",
        "t.kidl:3:27: descriptor field `pos` must be u64",
    );
    expect(
        "descriptor D { close: subtree; parent: same; }\nfn mk() -> D create;",
        "t.kidl:3:12: `D`: parent dependencies need `namespace: global` (the server stub rebuilds parents before children from creation records)",
    );
    expect(
        "descriptor D { namespace: global; close: subtree; parent: same; }\nfn mk() -> D create;",
        "t.kidl:3:12: `D` declares `parent: same`, but no `create` function takes a `parent` argument",
    );
    expect(
        "descriptor D { namespace: global; close: subtree; parent: same; }\nfn mk(p: D) -> D create;",
        "t.kidl:4:7: `create` function `mk` can take a descriptor only as its `parent`, and `p` is not marked so",
    );
    expect(
        "descriptor D { }\nfn mk(p: D parent) -> D create;",
        "t.kidl:4:7: `p`: `parent` marks the argument of a `create` function that is the parent of the descriptor it makes (same type, declared `parent: same`)",
    );
}

#[test]
fn global_rules() {
    expect(
        "descriptor D { namespace: global; states: a, b; }",
        "t.kidl:3:43: `D`: a global descriptor is shared by its clients, so it cannot have per-client states; keep such state in the server",
    );
    expect(
        "descriptor D { namespace: global; field pos: u64; }\nfn mk() -> D create;\nfn mv(d: D, n: u64 set(d.pos)) -> u64 restore(d.pos);",
        "t.kidl:5:4: `mv` restores a field of global descriptor `D`; a global descriptor's fields are per-client bookkeeping (`store`/`from`), never server state",
    );
    expect(
        "descriptor D { namespace: global; field pos: u64; }\nfn mk() -> D create;\nfn mv(d: D) -> u64 advance(d.pos);",
        "t.kidl:5:4: `mv` changes field `pos` of global descriptor `D` with `advance`/`set`; use `store`",
    );
}

#[test]
fn state_machine_rules() {
    let d = "descriptor D { states: idle, armed, done; }\nfn mk() -> D create;\n";
    expect(
        &format!("{d}fn go(d: D) transition(idle, armd);"),
        "t.kidl:5:13: `transition(idle, armd)`: `D` has no state `armd`; declared: [idle, armed, done]",
    );
    expect(
        &format!("{d}fn go(d: D) transition(idle, armed);"),
        "t.kidl:3:37: state `done` of `D` cannot be reached from `idle` by any transition, so recovery could not bring a descriptor back into it",
    );
    expect(
        &format!("{d}fn go(d: D, at: u64) transition(idle, armed);"),
        "t.kidl:5:13: argument `at` of transition `go` needs `remember`, `replay(..)` or `from(..)`: recovery replays transitions",
    );
    expect(
        &format!("{d}fn go(a: u32) transition(idle, armed);"),
        "t.kidl:5:15: `transition` needs a plain function taking exactly one descriptor, and `go` is not",
    );
    expect(
        "descriptor D { states: a, a; }",
        "t.kidl:3:27: duplicate state `a`",
    );
}

#[test]
fn store_and_from_rules() {
    let d = "descriptor D { field seen: u64; }\nfn mk() -> D create;\n";
    expect(
        &format!("{d}fn w(d: D) -> bool store(d.seen);"),
        "t.kidl:5:26: `store(d.seen)` needs a function returning an unsigned integer, and `w` returns `bool`",
    );
    expect(
        &format!("{d}fn w(d: D, s: u32 from(d.seen)) -> u64;"),
        "t.kidl:5:12: `from(d.seen)` fills in a u64 argument from a tracked field; `s` must be u64 without other tracking annotations",
    );
    expect(
        &format!("{d}fn w(d: D, s: u64 from(d.sen)) -> u64;"),
        "t.kidl:5:24: `from(d.sen)`: descriptor `D` has no field `sen`",
    );
    expect(
        "descriptor D { }\nfn mk() -> D create block;",
        "t.kidl:4:4: `create` function `mk` cannot `block`",
    );
}

#[test]
fn a_readonly_function_changes_nothing() {
    expect(
        "descriptor D { }\nfn mk() -> D create readonly;",
        "t.kidl:4:4: `mk` is `readonly` and `create`: a read-only function changes nothing in the server",
    );
    expect(
        "descriptor D { }\nfn mk() -> D create;\nfn rm(d: D) terminal readonly;",
        "t.kidl:5:4: `rm` is `readonly` and `terminal`: a read-only function changes nothing in the server",
    );
    expect(
        "fn poke() wakeup readonly;",
        "t.kidl:3:4: `poke` is `readonly` and `wakeup`: a read-only function changes nothing in the server",
    );
    expect(
        "fn peek() readonly(1);",
        "t.kidl:3:20: `readonly` takes no arguments",
    );
}

#[test]
fn range_checks() {
    expect(
        "fn f(a: str range(0, 1));",
        "t.kidl:3:6: `range` applies to integer arguments, and `a` is `str`",
    );
    expect(
        "fn f(a: u8 range(0, 300));",
        "t.kidl:3:6: range bound 300 does not fit in `u8`",
    );
    expect(
        "fn f(a: u32 max(4));",
        "t.kidl:3:6: `max` applies to str and bytes arguments, and `a` is `u32`",
    );
}

#[test]
fn remember_outside_create() {
    expect(
        "fn f(a: u32 remember);",
        "t.kidl:3:6: `a`: `remember` and `replay` apply only to arguments of a `create` or `transition` function",
    );
}

#[test]
fn create_argument_must_be_kept() {
    expect(
        &format!("{DESC}fn mk(a: u32) -> D create;"),
        "t.kidl:4:7: argument `a` of `create` function `mk` needs `remember` or `replay(..)`: recovery replays creation",
    );
}

#[test]
fn replay_literal_must_fit() {
    expect(
        &format!("{DESC}fn mk(a: u32 replay(true)) -> D create;"),
        "t.kidl:4:7: `replay(true)` is not a valid value for `a: u32`",
    );
    expect(
        &format!("{DESC}fn mk(a: u32 range(1, 9) replay(0)) -> D create;"),
        "t.kidl:4:7: `replay(0)` is not a valid value for `a: u32`",
    );
}

#[test]
fn create_must_return_a_descriptor() {
    expect(
        "fn mk() -> u64 create;",
        "t.kidl:3:4: `create` function `mk` must return a descriptor",
    );
}

#[test]
fn only_create_returns_descriptors() {
    expect(
        &format!("{DESC}{MAKE}fn g() -> D;"),
        "t.kidl:5:11: only a `create` function may return a descriptor (`D`)",
    );
}

#[test]
fn descriptor_without_create() {
    expect(
        "descriptor D { }",
        "t.kidl:3:12: descriptor `D` has no `create` function",
    );
}

#[test]
fn descriptor_with_two_creates() {
    expect(
        &format!("{DESC}{MAKE}fn mk2(tag: u64 remember) -> D create;"),
        "t.kidl:5:4: descriptor `D` is already created by `mk`; a local descriptor has one `create` function (a global one may have several)",
    );
}

#[test]
fn at_most_needs_lengths_or_unsigned_integers() {
    expect(
        "fn f(n: u32) -> u64 at_most(m);",
        "t.kidl:3:29: `at_most(m)`: `f` has no argument `m`",
    );
    expect(
        "fn f(n: i64) -> u64 at_most(n);",
        "t.kidl:3:29: `at_most(n)`: argument `n` is a `i64`, not an unsigned integer, bytes or a string",
    );
    expect(
        "fn f(n: u32) -> bool at_most(n);",
        "t.kidl:3:17: `at_most(n)` needs a function returning an unsigned integer, bytes or a string, and `f` returns `bool`",
    );
    expect(
        "fn f(n: u32) -> u32 at_most(3);",
        "t.kidl:3:29: `at_most` expects an argument's name, found `3`",
    );
    expect(
        "fn f(n: bytes) -> u64 above(n);",
        "t.kidl:3:29: `above(n)`: argument `n` is a `bytes`, not an unsigned integer",
    );
    expect(
        "fn f(n: u64) -> str above(n);",
        "t.kidl:3:17: `above(n)` needs a function returning an unsigned integer, and `f` returns `str`",
    );
}

#[test]
fn named_by_needs_a_local_create_and_a_remembered_u64() {
    let desc = "descriptor C { namespace: local; close: self; parent: none; }\n";
    expect(
        &format!("{desc}fn adopt(id: u64 remember) -> C create named_by(n);"),
        "t.kidl:4:49: `named_by(n)`: `adopt` has no argument `n`",
    );
    expect(
        &format!("{desc}fn adopt(id: u32 remember) -> C create named_by(id);"),
        "t.kidl:4:49: `named_by(id)`: argument `id` must be a `u64` marked `remember` (the stub rebuilds the descriptor from it), and it is a `u32`",
    );
    expect(
        &format!("{desc}fn adopt(id: u64 replay(0)) -> C create named_by(id);"),
        "t.kidl:4:50: `named_by(id)`: argument `id` must be a `u64` marked `remember` (the stub rebuilds the descriptor from it), and it is a `u64` without `remember`",
    );
    expect(
        "fn f(id: u64) -> u64 named_by(id);",
        "t.kidl:3:31: `named_by(id)` needs a `create` function returning a local descriptor, and `f` is not one",
    );
}

#[test]
fn tracked_field_needs_restore() {
    expect(
        &format!("{DESC}{MAKE}fn t(d: D) -> u64 advance(d.pos);"),
        "t.kidl:3:22: field `pos` of `D` is changed by `t` but no function restores it; add `restore(..pos)` to one",
    );
}

#[test]
fn field_references() {
    expect(
        &format!("{DESC}{MAKE}fn t(d: D) -> u64 advance(x.pos);"),
        "t.kidl:5:27: `advance(x.pos)`: `x` is not a descriptor argument of `t`",
    );
    expect(
        &format!("{DESC}{MAKE}fn t(d: D, p: u64 set(d.nope));"),
        "t.kidl:5:23: `set(d.nope)`: descriptor `D` has no field `nope`",
    );
    expect(
        &format!("{DESC}{MAKE}fn t(d: D) -> str advance(d.pos);"),
        "t.kidl:5:27: `advance(d.pos)` needs a function returning an unsigned integer or bytes, and `t` returns `str`",
    );
}

#[test]
fn restore_shape() {
    expect(
        &format!("{DESC}{MAKE}fn s(d: D, pos: u64) -> u64 restore(d.pos);"),
        "t.kidl:5:37: `restore(d.pos)`: a restore function takes exactly the descriptor `d` and one argument with `set(d.pos)`",
    );
}

#[test]
fn terminal_shape() {
    expect(
        &format!("{DESC}{MAKE}fn c(d: D) -> u32 terminal;"),
        "t.kidl:5:15: `terminal` function `c` must return unit",
    );
    expect(
        &format!("{DESC}{MAKE}fn c() terminal;"),
        "t.kidl:5:4: `terminal` function `c` must take exactly one descriptor",
    );
    expect(
        "fn c() create terminal;",
        "t.kidl:3:15: a function is either `create` or `terminal`, not both",
    );
}

#[test]
fn retry_ok_checks() {
    expect(
        "fn u() retry_ok(Gone);",
        "t.kidl:3:4: `retry_ok(Gone)`: unknown error `Gone`; declared: NotFound, Exists",
    );
    expect(
        "fn u() -> u32 retry_ok(Exists);",
        "t.kidl:3:4: `retry_ok` needs a plain function that returns unit, and `u` does not",
    );
}

#[test]
fn fails_checks() {
    expect(
        "fn u() fails(Gone);",
        "t.kidl:3:4: `fails(Gone)`: unknown error `Gone`; declared: NotFound, Exists",
    );
    expect(
        "fn u() fails();",
        "t.kidl:3:14: expected a value, found `)`",
    );
    expect(
        "fn u() fails(7);",
        "t.kidl:3:14: `fails` expects error names, found `7`",
    );
    expect(
        "fn u() fails;",
        "t.kidl:3:8: `fails` takes one or more error names",
    );
    expect(
        "fn u() retry_ok(Exists) fails(NotFound);",
        "t.kidl:3:4: `retry_ok(Exists)` names an error that `fails` says a correct server never answers `u` with",
    );
}

#[test]
fn infallible_checks() {
    expect(
        "fn u() infallible(NotFound);",
        "t.kidl:3:19: `infallible` takes no arguments",
    );
    expect(
        "fn u() fails(NotFound) infallible;",
        "t.kidl:3:24: a function takes `fails(..)` or `infallible`, not both",
    );
    expect(
        "fn u() infallible retry_ok(Exists);",
        "t.kidl:3:4: `retry_ok(Exists)` names an error that `infallible` says a correct server never answers `u` with",
    );
}

#[test]
fn file_name_must_match_interface() {
    let dir = std::env::temp_dir().join(format!("kidl-name-{}", std::process::id()));
    let out = dir.join("out");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("wrong.kidl"), "// x\ninterface right;\n").unwrap();
    let e = kintsugi_idl::compile_dir(&dir, &out).unwrap_err();
    let name = dir.file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(
        e.to_string(),
        format!("{name}/wrong.kidl:2:11: interface `right` must be in a file named `right.kidl`")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reboot_takes_forgets_or_keeps() {
    expect(
        "descriptor D { reboot: sometimes; }",
        "t.kidl:3:24: unknown reboot `sometimes`; expected forgets or keeps",
    );
}

#[test]
fn kept_global_descriptor() {
    expect(
        "descriptor D { namespace: global; reboot: keeps; }\nfn mk() -> D create;",
        "t.kidl:3:12: `D`: `reboot: keeps` is for local descriptors (the server stub rebuilds global ones from its creation records)",
    );
}
