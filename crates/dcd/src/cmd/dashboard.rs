//! `dcd status`: a live dashboard of the local daemon, refreshed every second from its
//! `/status` document: this peer and what it uses, the work it does, the swarm's peers, and a
//! layer coverage map with the gaps in red.
//!
//! [`render`] is a pure function of the status JSON and the view state (scroll, last error)
//! into a ratatui buffer, so the tests draw it on a `TestBackend` and read the cells. The
//! terminal loop around it only moves keys and fresh documents in; fetching runs on its own
//! thread so a slow daemon never freezes the keys. Fields the daemon does not send (older
//! versions, or `audits` / `excluded_peers` before they exist) are simply not shown.

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table, Widget};
use serde_json::Value;

use super::client::fetch_status_as;

/// How often the dashboard asks the daemon.
const REFRESH: Duration = Duration::from_secs(1);
/// Longest wait for one status document before the dashboard says the daemon is gone.
const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// Peer rows the coverage map shows before it summarises the rest.
const MAX_COVERAGE_ROWS: usize = 8;
/// Width of the coverage map's row labels.
const LABEL_W: usize = 12;
/// Terminals at least this wide show "This peer" and "Work" side by side.
const WIDE: u16 = 110;
/// Height of the "This peer" block.
const TOP_H: u16 = 13;

/// What the dashboard shows besides the status document.
#[derive(Clone, Debug, Default)]
pub struct View {
    /// The control API the status comes from.
    pub api: String,
    /// First peer row shown in the swarm table.
    pub scroll: usize,
    /// Why the last refresh failed (the status shown is then the last good one).
    pub error: Option<String>,
}

/// Draws the dashboard for `status` into `buf` over `area`; returns how many peer rows the
/// swarm table shows (the page size for PgUp/PgDn).
pub fn render(status: &Value, view: &View, area: Rect, buf: &mut Buffer) -> usize {
    let cov_rows = coverage_rows(status).len().min(MAX_COVERAGE_ROWS + 1);
    let wide = area.width >= WIDE;
    let [title, top, work_below, cov, peers] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(TOP_H),
        Constraint::Length(if wide { 0 } else { work_height(status) }),
        Constraint::Length(5 + cov_rows as u16),
        Constraint::Min(4),
    ])
    .areas(area);
    title_bar(status, view).render(title, buf);
    let (me, work) = if wide {
        let [me, work] =
            Layout::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)]).areas(top);
        (me, work)
    } else {
        (top, work_below)
    };
    this_peer(status).render(me, buf);
    work_panel(status, work.height.saturating_sub(2) as usize).render(work, buf);
    coverage_map(status, cov, buf);
    peers_table(status, view.scroll, peers, buf)
}

/// Height of the "Work" block when it sits under "This peer" (narrow terminals).
fn work_height(s: &Value) -> u16 {
    let audits = usize::from(s.get("audits").is_some_and(|a| !a.is_null()));
    let redone = usize::from(s.get("reroutes").is_some_and(|r| !r.is_null()));
    let excluded = if s.get("excluded_peers").is_some_and(|e| !e.is_null()) {
        1 + excluded_peers(s).len().min(4)
    } else {
        0
    };
    (2 + 4 + audits + redone + excluded) as u16
}

/// The rows a `--once` rendering needs to show everything.
pub fn height_needed(status: &Value, width: u16) -> u16 {
    let peers = status["peers"].as_array().map_or(0, Vec::len);
    let cov = coverage_rows(status).len().min(MAX_COVERAGE_ROWS + 1);
    let work = if width >= WIDE {
        0
    } else {
        work_height(status) as usize
    };
    (1 + TOP_H as usize + work + 5 + cov + 3 + peers.max(1)).min(1000) as u16
}

/// Runs the dashboard: once as text (`once`), or live until q / Esc. `first` is a status the
/// caller already fetched (so a missing daemon is reported before the screen is taken).
pub fn run(api: &str, token: Option<&str>, first: Value, once: bool) -> Result<ExitCode> {
    let mut view = View {
        api: api.to_string(),
        ..View::default()
    };
    if once {
        let width = ratatui::crossterm::terminal::size()
            .map(|(w, _)| w)
            .ok()
            .or_else(|| std::env::var("COLUMNS").ok()?.parse().ok())
            .unwrap_or(120)
            .clamp(60, 400);
        let area = Rect::new(0, 0, width, height_needed(&first, width));
        let mut buf = Buffer::empty(area);
        render(&first, &view, area, &mut buf);
        for line in buffer_lines(&buf) {
            println!("{}", line.trim_end());
        }
        return Ok(ExitCode::SUCCESS);
    }

    // Fetching runs on its own thread; a one-slot channel keeps at most one document in
    // flight, and the thread ends when the dashboard drops the receiver.
    let (tx, rx) = mpsc::sync_channel::<Result<Value, String>>(1);
    {
        let api = api.to_string();
        let token = token.map(str::to_string);
        std::thread::spawn(move || loop {
            std::thread::sleep(REFRESH);
            let r = fetch_status_as(&api, token.as_deref(), FETCH_TIMEOUT)
                .map_err(|e| format!("{e:#}"));
            if tx.send(r).is_err() {
                break;
            }
        });
    }

    let mut terminal = ratatui::try_init().context("starting the terminal dashboard")?;
    let result = (|| -> Result<()> {
        let mut status = first;
        let mut page = 1;
        let mut last_draw = Instant::now() - REFRESH;
        let mut dirty = true;
        loop {
            if dirty || last_draw.elapsed() >= REFRESH {
                terminal.draw(|f| {
                    let area = f.area();
                    page = render(&status, &view, area, f.buffer_mut()).max(1);
                })?;
                last_draw = Instant::now();
                dirty = false;
            }
            if event::poll(Duration::from_millis(100))? {
                if let Event::Key(k) = event::read()? {
                    if k.kind != KeyEventKind::Press {
                        continue;
                    }
                    let peers = status["peers"].as_array().map_or(0, Vec::len);
                    let last = peers.saturating_sub(page);
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                            return Ok(())
                        }
                        KeyCode::Up | KeyCode::Char('k') => {
                            view.scroll = view.scroll.saturating_sub(1)
                        }
                        KeyCode::Down | KeyCode::Char('j') => {
                            view.scroll = (view.scroll + 1).min(last)
                        }
                        KeyCode::PageUp => view.scroll = view.scroll.saturating_sub(page),
                        KeyCode::PageDown => view.scroll = (view.scroll + page).min(last),
                        KeyCode::Home => view.scroll = 0,
                        KeyCode::End => view.scroll = last,
                        _ => {}
                    }
                    dirty = true;
                }
            }
            match rx.try_recv() {
                Ok(Ok(s)) => {
                    status = s;
                    view.error = None;
                    dirty = true;
                }
                Ok(Err(e)) => {
                    view.error = Some(e);
                    dirty = true;
                }
                Err(_) => {}
            }
        }
    })();
    ratatui::restore();
    result?;
    Ok(ExitCode::SUCCESS)
}

/// The buffer's rows as text.
pub fn buffer_lines(buf: &Buffer) -> Vec<String> {
    let a = buf.area;
    (a.top()..a.bottom())
        .map(|y| {
            (a.left()..a.right())
                .map(|x| buf[(x, y)].symbol())
                .collect()
        })
        .collect()
}

fn title_bar(status: &Value, view: &View) -> Paragraph<'static> {
    let software = status["software"].as_str().unwrap_or("dcd");
    let mut spans = vec![
        Span::styled(
            " DaisyChain ",
            Style::new().add_modifier(Modifier::BOLD).fg(Color::Yellow),
        ),
        Span::raw(format!("· {software} · {} ", view.api)),
    ];
    match &view.error {
        Some(e) => spans.push(Span::styled(
            format!("· no daemon answers now ({e}); showing the last status "),
            Style::new().fg(Color::White).bg(Color::Red),
        )),
        None => spans.push(Span::styled(
            "· q quit · ↑↓ PgUp PgDn scroll peers",
            Style::new().fg(Color::DarkGray),
        )),
    }
    Paragraph::new(Line::from(spans))
}

fn label(name: &str) -> Span<'static> {
    Span::styled(format!("{name:<9}"), Style::new().fg(Color::DarkGray))
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn state_style(state: &str) -> Style {
    match state {
        "serving" => Style::new().fg(Color::Green),
        "loading" | "moving" => Style::new().fg(Color::Yellow),
        "leaving" => Style::new().fg(Color::Magenta),
        "excluded" => Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
        _ => Style::new(),
    }
}

fn this_peer(s: &Value) -> Paragraph<'static> {
    let mut lines = vec![Line::from(vec![
        label("peer"),
        Span::styled(
            text(&s["peer_id"]),
            Style::new().add_modifier(Modifier::BOLD),
        ),
    ])];
    lines.extend(address_lines(s));
    lines.push(network_line(s));
    lines.push(model_line(s));
    let state = s["state"].as_str().unwrap_or("?").to_string();
    let uptime = s["uptime_s"].as_u64().map_or("-".into(), duration);
    lines.push(Line::from(vec![
        label("state"),
        Span::styled(state.clone(), state_style(&state)),
        Span::raw(format!(" · up {uptime}")),
    ]));
    let head = if s["head"].as_bool() == Some(true) {
        " · head weights"
    } else {
        ""
    };
    lines.push(Line::from(vec![
        label("serves"),
        Span::raw(format!(
            "layers {} of {}{head}",
            text(&s["layers"]),
            text(&s["num_layers"])
        )),
    ]));
    if let Some(f) = fetch_line(&s["fetch"]) {
        lines.push(f);
    }
    lines.push(paused_line(s));
    lines.push(compute_line(s));
    lines.push(memory_line(&s["memory"]));
    let g = &s["generations"];
    lines.push(Line::from(vec![
        label("cap"),
        Span::raw(format!("{} generations at once", text(&g["max"]))),
    ]));
    Paragraph::new(lines).block(Block::bordered().title(" This peer "))
}

/// How the fetch of the model's pieces from peers goes, for a daemon that fetched it.
fn fetch_line(f: &Value) -> Option<Line<'static>> {
    let total = f["total_bytes"].as_u64()?;
    let done = f["done_bytes"].as_u64().unwrap_or(0);
    let corrupt = f["corrupt_peers"].as_array().map_or(0, Vec::len);
    let state = if f["finished"].as_bool() == Some(true) {
        "fetched"
    } else {
        "fetching"
    };
    let mut text = format!(
        "{state} {:.1} of {:.1} MB from peers ({} of {} pieces)",
        done as f64 / 1e6,
        total as f64 / 1e6,
        f["done_pieces"].as_u64().unwrap_or(0),
        f["total_pieces"].as_u64().unwrap_or(0)
    );
    if corrupt > 0 {
        text.push_str(&format!(" · {corrupt} peer(s) sent corrupt pieces"));
    }
    Some(Line::from(vec![label("weights"), Span::raw(text)]))
}

/// The listen addresses, at most two lines (the rest counted).
fn address_lines(s: &Value) -> Vec<Line<'static>> {
    let addrs: Vec<String> = s["listen_addrs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(text)
        .collect();
    // Our own /p2p/<id> suffix repeats the line above: leave it out.
    let suffix = format!("/p2p/{}", text(&s["peer_id"]));
    let addrs: Vec<&str> = addrs
        .iter()
        .map(|a| a.strip_suffix(&suffix).unwrap_or(a))
        .collect();
    if addrs.is_empty() {
        return vec![Line::from(vec![label("address"), Span::raw("-")])];
    }
    let mut lines = Vec::new();
    for (i, a) in addrs.iter().take(2).enumerate() {
        let more = if i == 1 && addrs.len() > 2 {
            format!("  (+{} more)", addrs.len() - 2)
        } else {
            String::new()
        };
        let l = if i == 0 { label("address") } else { label("") };
        lines.push(Line::from(vec![l, Span::raw(format!("{a}{more}"))]));
    }
    lines
}

/// Reachability, connections and the private swarm, if any.
fn network_line(s: &Value) -> Line<'static> {
    let c = &s["connections"];
    let mut parts = vec![format!(
        "{}, {} connections",
        s["reachability"].as_str().unwrap_or("unknown"),
        c["open"].as_u64().unwrap_or(0)
    )];
    if let Some(n) = c["relayed"].as_u64().filter(|n| *n > 0) {
        parts.push(format!("{n} relayed"));
    }
    if let Some(fp) = s["private_swarm"].as_str() {
        parts.push(format!("private swarm {fp}"));
    }
    Line::from(vec![label("network"), Span::raw(parts.join(" · "))])
}

/// The model's file name and the start of its id.
fn model_line(s: &Value) -> Line<'static> {
    let model = s["model"].as_str().map(|m| {
        std::path::Path::new(m)
            .file_name()
            .map_or(m.to_string(), |f| f.to_string_lossy().into_owned())
    });
    let id = s["model_id"]
        .as_str()
        .map(|i| i.chars().take(12).collect::<String>());
    Line::from(vec![
        label("model"),
        Span::raw(format!(
            "{} (id {})",
            model.unwrap_or_else(|| "-".into()),
            id.unwrap_or_else(|| "-".into())
        )),
    ])
}

/// Whether new work waits, and whether the daemon serves only while the machine is idle.
fn paused_line(s: &Value) -> Line<'static> {
    let idle_only = s["idle_only"].as_bool() == Some(true);
    let paused = if s["paused"].as_bool() == Some(true) {
        Span::styled(
            if idle_only {
                "PAUSED: the machine is busy, new work waits"
            } else {
                "PAUSED: new work waits"
            },
            Style::new().fg(Color::Black).bg(Color::Yellow),
        )
    } else {
        Span::styled("no", Style::new().fg(Color::Green))
    };
    Line::from(vec![
        label("paused"),
        paused,
        Span::raw(if idle_only {
            " · idle-only: on"
        } else {
            " · idle-only: off"
        }),
    ])
}

/// Kernel, threads and throughput.
fn compute_line(s: &Value) -> Line<'static> {
    let tput = s["throughput"]
        .as_f64()
        .map_or("-".into(), |t| format!("{t:.1} tok/s"));
    Line::from(vec![
        label("compute"),
        Span::raw(format!(
            "kernel {} · {} thread{} · {tput}",
            text(&s["kernel"]),
            text(&s["threads"]),
            if s["threads"].as_u64() == Some(1) {
                ""
            } else {
                "s"
            }
        )),
    ])
}

/// Weights and KV caches against the memory budget (red above 95 %).
fn memory_line(m: &Value) -> Line<'static> {
    let weights = m["weights"].as_u64().unwrap_or(0);
    let kv = m["kv_caches"].as_u64().unwrap_or(0);
    let mut mem = vec![
        label("memory"),
        Span::raw(format!("weights {} · KV {} · ", bytes(weights), bytes(kv))),
    ];
    match m["budget"].as_u64() {
        Some(b) if b > 0 => {
            let pct = (weights + kv) as f64 * 100.0 / b as f64;
            let style = if pct > 95.0 {
                Style::new().fg(Color::Red)
            } else {
                Style::new()
            };
            mem.push(Span::styled(
                format!("budget {} ({pct:.0}% used)", bytes(b)),
                style,
            ));
        }
        _ => mem.push(Span::raw("no budget")),
    }
    Line::from(mem)
}

fn work_panel(s: &Value, rows: usize) -> Paragraph<'static> {
    let g = &s["generations"];
    let mut lines = vec![
        Line::from(vec![
            label("running"),
            Span::raw(format!(
                "{} of {} generations",
                text(&g["active"]),
                text(&g["max"])
            )),
        ]),
        Line::from(vec![label("requests"), Span::raw(text(&g["requests"]))]),
        Line::from(vec![
            label("tokens"),
            Span::raw(text(&s["tokens_generated"])),
        ]),
        Line::from(vec![
            label("hops"),
            Span::raw(format!(
                "{} ({} positions)",
                text(&s["hops_served"]),
                text(&s["positions_served"])
            )),
        ]),
    ];
    if let Some(a) = s.get("audits").filter(|a| !a.is_null()) {
        lines.push(audits_line(a));
    }
    // Work redone: stages handed to another peer, or generations recomputed, without a peer
    // whose hop could not be used; tokens corrected after a proven lie.
    if let Some(r) = s.get("reroutes").filter(|r| !r.is_null()) {
        lines.push(Line::from(vec![
            label("redone"),
            Span::raw(format!(
                "stages replaced {} · rerouted {} · corrected {}",
                text(&s["stages_replaced"]),
                text(r),
                text(&s["corrections"])
            )),
        ]));
    }
    let excluded = excluded_peers(s);
    if s.get("excluded_peers").is_some_and(|e| !e.is_null()) {
        if excluded.is_empty() {
            lines.push(Line::from(vec![
                label("excluded"),
                Span::styled("none", Style::new().fg(Color::Green)),
            ]));
        } else {
            lines.push(Line::from(vec![
                label("excluded"),
                Span::styled(
                    format!("{} peers", excluded.len()),
                    Style::new().fg(Color::Red),
                ),
            ]));
            let room = rows.saturating_sub(lines.len()).max(1);
            let shown = if excluded.len() > room {
                room - 1
            } else {
                excluded.len()
            };
            for (id, why) in excluded.iter().take(shown) {
                let why = why.as_ref().map_or(String::new(), |w| format!(": {w}"));
                lines.push(Line::from(Span::styled(
                    format!("  {}{why}", short_id(id)),
                    Style::new().fg(Color::Red),
                )));
            }
            if shown < excluded.len() {
                lines.push(Line::from(format!(
                    "  … and {} more",
                    excluded.len() - shown
                )));
            }
        }
    }
    Paragraph::new(lines).block(Block::bordered().title(" Work "))
}

fn audits_line(a: &Value) -> Line<'static> {
    let mut spans = vec![label("audits")];
    match a.as_object() {
        Some(o) => {
            // The counters everyone knows first, then whatever else the daemon reports.
            let mut keys: Vec<&String> = o.keys().collect();
            let rank = |k: &str| {
                ["run", "passed", "failed"]
                    .iter()
                    .position(|x| *x == k)
                    .unwrap_or(3)
            };
            keys.sort_by_key(|k| (rank(k), (*k).clone()));
            // Per-peer tallies are a table, not a counter (a proven liar is listed as excluded).
            keys.retain(|k| !o[*k].is_object() && !o[*k].is_array());
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    spans.push(Span::raw(" · "));
                }
                let v = &o[k];
                let bad = k == "failed" && v.as_u64().is_some_and(|n| n > 0);
                let style = if bad {
                    Style::new().fg(Color::White).bg(Color::Red)
                } else {
                    Style::new()
                };
                spans.push(Span::styled(format!("{k} {}", text(v)), style));
            }
        }
        None => spans.push(Span::raw(text(a))),
    }
    Line::from(spans)
}

/// The excluded peers as (id, reason).
fn excluded_peers(s: &Value) -> Vec<(String, Option<String>)> {
    s["excluded_peers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| match e {
            Value::String(id) => Some((id.clone(), None)),
            Value::Object(o) => {
                let id = o
                    .get("peer_id")
                    .or_else(|| o.get("peer"))?
                    .as_str()?
                    .to_string();
                let why = o.get("reason").or_else(|| o.get("why")).map(text);
                Some((id, why))
            }
            _ => None,
        })
        .collect()
}

/// A half-open layer range "A..B".
fn range(v: &Value) -> Option<(u32, u32)> {
    let (a, b) = v.as_str()?.split_once("..")?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

/// A row of the coverage map: whose it is and which layers it serves.
struct CoverageRow {
    label: String,
    layers: Option<(u32, u32)>,
    me: bool,
}

/// The coverage map's rows: this peer, then the others.
fn coverage_rows(s: &Value) -> Vec<CoverageRow> {
    let mut rows = vec![CoverageRow {
        label: "this peer".into(),
        layers: range(&s["layers"]),
        me: true,
    }];
    for p in s["peers"].as_array().into_iter().flatten() {
        rows.push(CoverageRow {
            label: short_id(p["peer_id"].as_str().unwrap_or("?")),
            layers: range(&p["layers"]),
            me: false,
        });
    }
    rows
}

fn coverage_map(s: &Value, area: Rect, buf: &mut Buffer) {
    let block = Block::bordered().title(" Layer coverage (replicas per layer) ");
    let inner = block.inner(area);
    block.render(area, buf);
    let n = s["num_layers"].as_u64().unwrap_or(0) as usize;
    let cov: Vec<u64> = s["coverage"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| v.as_u64().unwrap_or(0))
        .collect();
    let n = n.max(cov.len());
    if n == 0 {
        Paragraph::new("no layer information yet").render(inner, buf);
        return;
    }
    let replicas: Vec<u64> = (0..n).map(|l| cov.get(l).copied().unwrap_or(0)).collect();
    let grid = Grid::new(n, inner.width as usize);
    let mut lines = vec![grid.index_line(), grid.replicas_line(&replicas)];
    let room = (inner.height as usize).saturating_sub(3);
    lines.extend(grid.peer_lines(&coverage_rows(s), room));
    lines.push(gaps_line(&replicas));
    Paragraph::new(lines).render(inner, buf);
}

/// A layer gap: white on red.
fn gap_style() -> Style {
    Style::new()
        .fg(Color::White)
        .bg(Color::Red)
        .add_modifier(Modifier::BOLD)
}

/// The coverage map's columns: `cells` cells of `cw` characters after the row labels, each
/// standing for `per` consecutive layers of `n`.
struct Grid {
    n: usize,
    cw: usize,
    per: usize,
    cells: usize,
}

impl Grid {
    /// One cell per layer when it fits in `width`, else each cell stands for several layers
    /// (and shows the fewest replicas among them, so a gap is never hidden).
    fn new(n: usize, width: usize) -> Grid {
        let avail = width.saturating_sub(LABEL_W).max(1);
        let (cw, per) = if n * 3 <= avail {
            (3, 1)
        } else if n * 2 <= avail {
            (2, 1)
        } else {
            (1, n.div_ceil(avail))
        };
        Grid {
            n,
            cw,
            per,
            cells: n.div_ceil(per),
        }
    }

    /// The layers cell `c` stands for.
    fn layers_of(&self, c: usize) -> std::ops::Range<usize> {
        (c * self.per)..((c + 1) * self.per).min(self.n)
    }

    /// The "layer" row: layer numbers every `step` layers, a round number of layers, a whole
    /// number of cells, wide enough for the longest number and a space.
    fn index_line(&self) -> Line<'static> {
        let (cw, per) = (self.cw, self.per);
        let digits = self.n.to_string().len();
        let step = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000]
            .into_iter()
            .chain((1..).map(|k| k * 1000))
            .find(|&s| s % per == 0 && (s / per) * cw > digits)
            .unwrap_or(per);
        let mut idx = vec![' '; self.cells * cw];
        for c in (0..self.cells).filter(|c| (c * per) % step == 0) {
            let l = (c * per).to_string();
            let at = c * cw;
            for (i, ch) in l.chars().enumerate() {
                if let Some(slot) = idx.get_mut(at + i) {
                    *slot = ch;
                }
            }
        }
        Line::from(vec![
            Span::styled(
                format!("{:<LABEL_W$}", "layer"),
                Style::new().fg(Color::DarkGray),
            ),
            Span::styled(
                idx.into_iter().collect::<String>(),
                Style::new().fg(Color::DarkGray),
            ),
        ])
    }

    /// The "replicas" row: each cell's fewest replicas ("+" above 9), gaps in red.
    fn replicas_line(&self, replicas: &[u64]) -> Line<'static> {
        let cw = self.cw;
        let mut rep = vec![Span::styled(
            format!("{:<LABEL_W$}", "replicas"),
            Style::new().fg(Color::DarkGray),
        )];
        for c in 0..self.cells {
            let r = self.layers_of(c).map(|l| replicas[l]).min().unwrap_or(0);
            let t = if r > 9 {
                "+".to_string()
            } else {
                r.to_string()
            };
            let t = format!("{t:<cw$}");
            rep.push(if r == 0 {
                Span::styled(t, gap_style())
            } else {
                Span::raw(t)
            });
        }
        Line::from(rep)
    }

    /// One row per peer (this peer green, the others cyan) as far as `room` rows and
    /// `MAX_COVERAGE_ROWS` allow, then a line counting the peers left out.
    fn peer_lines(&self, rows: &[CoverageRow], room: usize) -> Vec<Line<'static>> {
        let cw = self.cw;
        let shown = if rows.len() > room {
            room.saturating_sub(1)
        } else {
            rows.len()
        };
        let mut lines = Vec::new();
        for CoverageRow {
            label: name,
            layers,
            me,
        } in rows.iter().take(shown.min(MAX_COVERAGE_ROWS))
        {
            let mut spans = vec![Span::raw(format!("{:<LABEL_W$}", name))];
            let color = if *me { Color::Green } else { Color::Cyan };
            for c in 0..self.cells {
                let serves = layers.is_some_and(|(a, b)| {
                    self.layers_of(c)
                        .any(|l| (a as usize..b as usize).contains(&l))
                });
                let mark: String = if serves {
                    "█".repeat(cw.min(2))
                } else {
                    " ".repeat(cw.min(2))
                };
                spans.push(Span::styled(format!("{mark:<cw$}"), Style::new().fg(color)));
            }
            lines.push(Line::from(spans));
        }
        let hidden = rows.len() - shown.min(MAX_COVERAGE_ROWS).min(rows.len());
        if hidden > 0 {
            lines.push(Line::from(Span::styled(
                format!("… and {hidden} more peers"),
                Style::new().fg(Color::DarkGray),
            )));
        }
        lines
    }
}

/// The verdict under the map: every layer served (and how many times at least), or the gaps.
fn gaps_line(replicas: &[u64]) -> Line<'static> {
    let gaps = gap_ranges(replicas);
    if gaps.is_empty() {
        let min = replicas.iter().copied().min().unwrap_or(0);
        return Line::from(Span::styled(
            format!(
                "every layer is served (at least {min} replica{})",
                if min == 1 { "" } else { "s" }
            ),
            Style::new().fg(Color::Green),
        ));
    }
    let list: Vec<String> = gaps
        .iter()
        .map(|(a, b)| {
            if b - a == 1 {
                format!("layer {a}")
            } else {
                format!("layers {a}..{b}")
            }
        })
        .collect();
    Line::from(Span::styled(
        format!(
            "GAP: {} served by no peer; generations cannot run",
            list.join(", ")
        ),
        gap_style(),
    ))
}

/// Maximal runs of layers with no replica, as half-open ranges.
fn gap_ranges(cov: &[u64]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (l, &r) in cov.iter().chain(std::iter::once(&1)).enumerate() {
        match (r == 0, start) {
            (true, None) => start = Some(l),
            (false, Some(a)) => {
                out.push((a, l));
                start = None;
            }
            _ => {}
        }
    }
    out
}

fn peers_table(s: &Value, scroll: usize, area: Rect, buf: &mut Buffer) -> usize {
    let peers: Vec<&Value> = s["peers"].as_array().into_iter().flatten().collect();
    let excluded: HashSet<String> = excluded_peers(s).into_iter().map(|(id, _)| id).collect();
    let visible = (area.height as usize).saturating_sub(3);
    let scroll = scroll.min(peers.len().saturating_sub(visible));
    let end = (scroll + visible).min(peers.len());
    let title = if peers.is_empty() {
        " Swarm: no other peers seen yet ".to_string()
    } else if visible >= peers.len() {
        format!(" Swarm: {} other peers ", peers.len())
    } else {
        format!(
            " Swarm: {} other peers (showing {}–{}) ",
            peers.len(),
            scroll + 1,
            end
        )
    };
    // Narrow terminals leave out how each peer is connected (direct or relayed).
    let link = area.width >= WIDE;
    let mut widths = vec![10u16, 7, 4, 9, 7, 9, 4, 8, 9];
    // The column of `link` in `widths`, and in each row (after the peer id).
    const LINK: usize = 7;
    if !link {
        widths.remove(LINK);
    }
    let fixed: u16 = widths.iter().sum::<u16>() + widths.len() as u16;
    let id_w = area.width.saturating_sub(2 + fixed).max(14) as usize;
    let mut header = vec![
        "peer",
        "software",
        "layers",
        "head",
        "state",
        "tok/s",
        "free mem",
        "gens",
        "link",
        "last seen",
    ];
    if !link {
        header.remove(LINK + 1);
    }
    let header = Row::new(header).style(
        Style::new()
            .fg(Color::DarkGray)
            .add_modifier(Modifier::BOLD),
    );
    let rows: Vec<Row> = peers[scroll..end]
        .iter()
        .map(|p| {
            let id = p["peer_id"].as_str().unwrap_or("?");
            let is_excluded = excluded.contains(id);
            let state = if is_excluded {
                "excluded".to_string()
            } else {
                text(&p["state"])
            };
            let seen = p["last_seen_ms"]
                .as_u64()
                .map_or("-".into(), |ms| format!("{:.1} s ago", ms as f64 / 1000.0));
            let mut cells = vec![
                Cell::from(fit_id(id, id_w)),
                Cell::from(text(&p["software"])),
                Cell::from(text(&p["layers"])),
                Cell::from(if p["head"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "no"
                }),
                Cell::from(Span::styled(state.clone(), state_style(&state))),
                Cell::from(
                    p["throughput"]
                        .as_f64()
                        .map_or("-".into(), |t| format!("{t:.1}")),
                ),
                Cell::from(p["free_memory"].as_u64().map_or("-".into(), bytes)),
                Cell::from(text(&p["active_generations"])),
                Cell::from(text(&p["connection"])),
                Cell::from(seen),
            ];
            if !link {
                cells.remove(LINK + 1);
            }
            Row::new(cells).style(if is_excluded {
                Style::new().fg(Color::Red)
            } else {
                Style::new()
            })
        })
        .collect();
    let mut constraints = vec![Constraint::Length(id_w as u16)];
    constraints.extend(widths.iter().map(|w| Constraint::Length(*w)));
    Table::new(rows, constraints)
        .header(header)
        .block(Block::bordered().title(title))
        .render(area, buf);
    visible
}

/// A peer id cut to `w` characters in the middle ("12D3Ko…x7Yz").
fn fit_id(id: &str, w: usize) -> String {
    let chars: Vec<char> = id.chars().collect();
    if chars.len() <= w {
        return id.to_string();
    }
    let tail = (w - 1) / 2;
    let head = w - 1 - tail;
    format!(
        "{}…{}",
        chars[..head].iter().collect::<String>(),
        chars[chars.len() - tail..].iter().collect::<String>()
    )
}

/// The short form of a peer id used in the coverage map and lists.
pub fn short_id(id: &str) -> String {
    fit_id(id, LABEL_W - 1)
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn duration(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {:02}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;
    use serde_json::json;

    const ME: &str = "12D3KooWMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMe0001";
    const A: &str = "12D3KooWAlphaAlphaAlphaAlphaAlphaAlphaAlphaAaaa02";
    const B: &str = "12D3KooWBetaBetaBetaBetaBetaBetaBetaBetaBetaBbb03";

    fn sample() -> Value {
        json!({
            "peer_id": ME,
            "listen_addrs": [format!("/ip4/127.0.0.1/tcp/7371/p2p/{ME}"), "/ip4/10.0.0.2/tcp/7371"],
            "software": "dcd 0.1.0",
            "model": "/models/llama",
            "model_id": "0123456789abcdef0123",
            "num_layers": 6,
            "layers": "0..2",
            "head": true,
            "state": "serving",
            "paused": false,
            "idle_only": false,
            "uptime_s": 3725,
            "throughput": 41.5,
            "kernel": "avx2",
            "threads": 2,
            "memory": {"budget": 1u64 << 30, "weights": 3u64 << 20, "kv_caches": 1u64 << 20},
            "generations": {"active": 1, "max": 8, "requests": 17},
            "hops_served": 40,
            "positions_served": 512,
            "tokens_generated": 123,
            "coverage": [1, 2, 1, 0, 0, 1],
            "peers": [
                {"peer_id": A, "layers": "1..3", "head": false, "state": "serving", "throughput": 12.0,
                 "free_memory": 2u64 << 30, "active_generations": 0, "software": "dcd 0.1.0", "last_seen_ms": 300},
                {"peer_id": B, "layers": "5..6", "head": false, "state": "loading", "throughput": 0.0,
                 "free_memory": null, "active_generations": 0, "software": "dcd 0.0.9", "last_seen_ms": 1200},
            ],
        })
    }

    fn draw(status: &Value, view: &View, w: u16, h: u16) -> (Terminal<TestBackend>, usize) {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        let mut page = 0;
        t.draw(|f| {
            let area = f.area();
            page = render(status, view, area, f.buffer_mut());
        })
        .unwrap();
        (t, page)
    }

    fn screen(t: &Terminal<TestBackend>) -> String {
        buffer_lines(t.backend().buffer()).join("\n")
    }

    /// (x, y) where the coverage row `label` starts (just inside the border).
    fn row(t: &Terminal<TestBackend>, label: &str) -> (u16, u16) {
        let (x, y) = find(t, &format!("│{label}")).unwrap_or_else(|| panic!("no {label} row"));
        (x + 1, y)
    }

    /// (x, y) of the first occurrence of `needle` on the screen.
    fn find(t: &Terminal<TestBackend>, needle: &str) -> Option<(u16, u16)> {
        buffer_lines(t.backend().buffer())
            .iter()
            .enumerate()
            .find_map(|(y, l)| {
                let byte = l.find(needle)?;
                Some((l[..byte].chars().count() as u16, y as u16))
            })
    }

    #[test]
    fn shows_this_peer_its_resources_and_the_swarm() {
        let view = View {
            api: "http://127.0.0.1:7370".into(),
            ..View::default()
        };
        let (t, _) = draw(&sample(), &view, 140, 40);
        let s = screen(&t);
        for needle in [
            ME,
            A,
            B,
            "http://127.0.0.1:7370",
            "address  /ip4/127.0.0.1/tcp/7371 ",
            "/ip4/10.0.0.2/tcp/7371",
            "llama",
            "serving · up 1h 02m",
            "layers 0..2 of 6 · head weights",
            "kernel avx2 · 2 threads · 41.5 tok/s",
            "weights 3.0 MiB · KV 1.0 MiB · budget 1.0 GiB (0% used)",
            "8 generations at once",
            "1 of 8 generations",
            "idle-only: off",
            "dcd 0.0.9",
            "loading",
            "0.3 s ago",
        ] {
            assert!(s.contains(needle), "{needle:?} not on the screen:\n{s}");
        }
        assert!(
            !s.contains("audits"),
            "no audits in the JSON, none on screen:\n{s}"
        );
    }

    #[test]
    fn the_coverage_map_marks_gaps_in_red() {
        let (t, _) = draw(&sample(), &View::default(), 140, 40);
        let s = screen(&t);
        assert!(s.contains("GAP: layers 3..5 served by no peer"), "{s}");
        let (x, y) = row(&t, "replicas");
        let cells: String = (0..6)
            .map(|l| {
                t.backend().buffer()[(x + LABEL_W as u16 + 3 * l, y)]
                    .symbol()
                    .to_string()
            })
            .collect();
        assert_eq!(cells, "121001");
        let buf = t.backend().buffer();
        for l in 0..6u16 {
            let cell = &buf[(x + LABEL_W as u16 + 3 * l, y)];
            let red = cell.bg == Color::Red;
            assert_eq!(red, l == 3 || l == 4, "layer {l}: {cell:?}");
        }
        // The rows: this peer serves 0..2, A serves 1..3, B serves 5..6.
        let (_, me_y) = row(&t, "this peer");
        let marks = |y: u16| -> String {
            (0..6)
                .map(|l| {
                    if buf[(x + LABEL_W as u16 + 3 * l, y)].symbol() == "█" {
                        '#'
                    } else {
                        '.'
                    }
                })
                .collect()
        };
        assert_eq!(marks(me_y), "##....");
        let (_, a_y) = row(&t, &short_id(A));
        assert_eq!(marks(a_y), ".##...");
        let (_, b_y) = row(&t, &short_id(B));
        assert_eq!(marks(b_y), ".....#");
    }

    #[test]
    fn full_coverage_is_green_and_says_so() {
        let mut s = sample();
        s["coverage"] = json!([1, 2, 1, 1, 1, 1]);
        let (t, _) = draw(&s, &View::default(), 140, 40);
        let text = screen(&t);
        assert!(
            text.contains("every layer is served (at least 1 replica)"),
            "{text}"
        );
        assert!(!text.contains("GAP"), "{text}");
    }

    #[test]
    fn many_layers_share_cells_without_hiding_a_gap() {
        let mut s = sample();
        let mut cov = vec![json!(1); 300];
        cov[200] = json!(0);
        s["num_layers"] = json!(300);
        s["coverage"] = json!(cov);
        let (t, _) = draw(&s, &View::default(), 100, 40);
        let text = screen(&t);
        assert!(text.contains("GAP: layer 200 served by no peer"), "{text}");
        let (x, y) = row(&t, "replicas");
        let buf = t.backend().buffer();
        let zeros = (x + LABEL_W as u16..99)
            .filter(|&cx| buf[(cx, y)].symbol() == "0")
            .count();
        assert_eq!(zeros, 1, "{text}");
        // 300 layers in 86 columns: four layers a cell, numbered every 20 layers.
        let (_, iy) = row(&t, "layer ");
        let numbers = &buffer_lines(buf)[iy as usize];
        assert!(numbers.contains("0    20   40   60"), "{numbers}");
    }

    #[test]
    fn paused_idle_only_peer_says_why() {
        let mut s = sample();
        s["paused"] = json!(true);
        s["idle_only"] = json!(true);
        s["memory"]["budget"] = Value::Null;
        let (t, _) = draw(&s, &View::default(), 140, 40);
        let text = screen(&t);
        assert!(text.contains("PAUSED: the machine is busy"), "{text}");
        assert!(text.contains("idle-only: on"), "{text}");
        assert!(text.contains("no budget"), "{text}");
    }

    #[test]
    fn audits_and_excluded_peers_show_when_present() {
        let mut s = sample();
        s["audits"] = json!({"run": 12, "passed": 11, "failed": 1, "per_peer": {
            A: {"run": 6, "passed": 6, "failed": 0},
            B: {"run": 6, "passed": 5, "failed": 1},
        }});
        s["excluded_peers"] = json!([{"peer_id": B, "reason": "fraud proof"}]);
        s["stages_replaced"] = json!(3);
        s["reroutes"] = json!(2);
        s["corrections"] = json!(1);
        let (t, _) = draw(&s, &View::default(), 140, 40);
        let text = screen(&t);
        assert!(text.contains("run 12 · passed 11 · failed 1"), "{text}");
        assert!(
            text.contains("stages replaced 3 · rerouted 2 · corrected 1"),
            "{text}"
        );
        // The per-peer table is not dumped into the counters.
        assert!(!text.contains("per_peer"), "{text}");
        assert!(text.contains("1 peers"), "{text}");
        assert!(
            text.contains(&format!("{}: fraud proof", short_id(B))),
            "{text}"
        );
        let (x, y) = find(&t, "failed 1").unwrap();
        assert_eq!(t.backend().buffer()[(x, y)].bg, Color::Red);
        // The excluded peer's row in the swarm table says so.
        let (_, row) = find(&t, B).unwrap();
        let line = &buffer_lines(t.backend().buffer())[row as usize];
        assert!(line.contains("excluded"), "{line}");
        // Plain ids work too.
        s["excluded_peers"] = json!([A]);
        let (t, _) = draw(&s, &View::default(), 140, 40);
        assert!(screen(&t).contains(&format!("  {}", short_id(A))));
    }

    #[test]
    fn the_peer_list_scrolls() {
        let mut s = sample();
        let peers: Vec<Value> = (0..30)
            .map(|i| json!({"peer_id": format!("12D3KooWpeer{i:02}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"), "layers": "0..1",
                            "head": false, "state": "serving", "throughput": 1.0, "free_memory": 1,
                            "active_generations": 0, "software": "dcd 0.1.0", "last_seen_ms": 10}))
            .collect();
        s["peers"] = json!(peers);
        let (t, page) = draw(&s, &View::default(), 140, 40);
        let text = screen(&t);
        assert!(page > 0 && page < 30, "{page}");
        assert!(text.contains("12D3KooWpeer00"), "{text}");
        assert!(!text.contains("12D3KooWpeer29"), "{text}");
        assert!(text.contains(&format!("(showing 1–{page})")), "{text}");
        let view = View {
            scroll: 5,
            ..View::default()
        };
        let (t, _) = draw(&s, &view, 140, 40);
        let text = screen(&t);
        let table = &text[text.find("Swarm").unwrap()..];
        assert!(!table.contains("12D3KooWpeer04"), "{table}");
        assert!(table.contains("12D3KooWpeer05"), "{table}");
        // Scrolling past the end shows the last page.
        let view = View {
            scroll: 1000,
            ..View::default()
        };
        let (t, _) = draw(&s, &view, 140, 40);
        let text = screen(&t);
        assert!(text.contains("12D3KooWpeer29"), "{text}");
        assert!(
            text.contains(&format!("(showing {}–30)", 31 - page)),
            "{text}"
        );
    }

    #[test]
    fn a_lost_daemon_is_reported_over_the_last_status() {
        let view = View {
            api: "http://127.0.0.1:7370".into(),
            error: Some("connection refused".into()),
            ..View::default()
        };
        let (t, _) = draw(&sample(), &view, 160, 40);
        let text = screen(&t);
        assert!(
            text.contains("no daemon answers now (connection refused)"),
            "{text}"
        );
        assert!(text.contains(ME), "{text}");
    }

    #[test]
    fn the_network_shows_reachability_and_each_peers_link_when_wide() {
        let mut s = sample();
        s["reachability"] = json!("private");
        s["connections"] = json!({"open": 3, "relayed": 1, "max": 256});
        s["private_swarm"] = json!("c0ffee12");
        s["peers"][0]["connection"] = json!("relayed");
        let (t, _) = draw(&s, &View::default(), 160, 40);
        let text = screen(&t);
        assert!(
            text.contains("private, 3 connections · 1 relayed · private swarm c0ffee12"),
            "{text}"
        );
        assert!(text.contains("link") && text.contains("relayed "), "{text}");
        let (t, _) = draw(&s, &View::default(), 80, 40);
        assert!(!screen(&t).contains(" link "), "{}", screen(&t));
    }

    #[test]
    fn a_sparse_document_renders() {
        let (t, page) = draw(&json!({}), &View::default(), 80, 24);
        let text = screen(&t);
        assert!(text.contains("no layer information yet"), "{text}");
        assert!(text.contains("no other peers seen yet"), "{text}");
        assert!(page > 0);
    }

    #[test]
    fn narrow_terminals_stack_the_panels_and_shorten_peer_ids() {
        let (t, _) = draw(&sample(), &View::default(), 80, 40);
        let text = screen(&t);
        assert!(!text.contains(A), "{text}");
        assert!(text.contains(&fit_id(A, 14)), "{text}");
        assert_eq!(fit_id(A, 14).chars().count(), 14);
        assert!(text.contains(&format!("peer     {ME}")), "{text}");
        let (_, me) = find(&t, "This peer").unwrap();
        let (_, work) = find(&t, "Work").unwrap();
        assert!(work > me, "{text}");
        assert!(text.contains("1 of 8 generations"), "{text}");
    }

    #[test]
    fn once_height_fits_every_peer() {
        let s = sample();
        let h = height_needed(&s, 140);
        let area = Rect::new(0, 0, 140, h);
        let mut buf = Buffer::empty(area);
        let page = render(&s, &View::default(), area, &mut buf);
        assert!(page >= 2);
        let text = buffer_lines(&buf).join("\n");
        assert!(text.contains(A) && text.contains(B), "{text}");
    }

    #[test]
    fn formats() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
        assert_eq!(duration(59), "59s");
        assert_eq!(duration(3725), "1h 02m");
        assert_eq!(duration(90061), "1d 01h");
        assert_eq!(
            gap_ranges(&[0, 1, 0, 0, 1, 0]),
            vec![(0, 1), (2, 4), (5, 6)]
        );
        assert_eq!(gap_ranges(&[1, 1]), vec![]);
    }
}
