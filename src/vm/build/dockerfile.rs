//! Where a Dockerfile's instructions are, so a failed build names the line:
//! buildah reports `STEP 3/5: RUN ...` (`[2/2] STEP 1/3: ...` in a
//! multi-stage build); this maps that back to `Dockerfile line 7`.

/// One instruction: the line it starts on (1-based), its first words.
#[derive(Debug, Clone, PartialEq)]
pub struct Instruction {
    pub line: usize,
    pub text: String,
}

/// Instructions by stage (a stage starts at each `FROM`), with `\`
/// continuations joined, comments and blank lines skipped.
pub fn stages(text: &str) -> Vec<Vec<Instruction>> {
    let mut out: Vec<Vec<Instruction>> = Vec::new();
    let mut cur: Option<Instruction> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if cur.is_none() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        let (body, cont) = match line.strip_suffix('\\') {
            Some(b) => (b.trim_end(), true),
            None => (line, false),
        };
        match &mut cur {
            Some(c) => {
                if !line.starts_with('#') {
                    c.text.push(' ');
                    c.text.push_str(body);
                }
            }
            None => {
                cur = Some(Instruction {
                    line: i + 1,
                    text: body.to_string(),
                })
            }
        }
        if !cont {
            if let Some(c) = cur.take() {
                let is_from = c
                    .text
                    .split_whitespace()
                    .next()
                    .is_some_and(|w| w.eq_ignore_ascii_case("FROM"));
                if is_from || out.is_empty() {
                    out.push(Vec::new());
                }
                if let Some(s) = out.last_mut() {
                    s.push(c);
                }
            }
        }
    }
    if let Some(c) = cur {
        if out.is_empty() {
            out.push(Vec::new());
        }
        if let Some(s) = out.last_mut() {
            s.push(c);
        }
    }
    out
}

/// The instruction of the last `STEP n/m:` line of buildah's output.
pub fn failed_step<'a>(stages: &'a [Vec<Instruction>], log: &[String]) -> Option<&'a Instruction> {
    let line = log.iter().rev().find_map(|l| {
        let at = l.find("STEP ")?;
        let (stage, rest) = (&l[..at], &l[at + 5..]);
        let n: usize = rest.split('/').next()?.trim().parse().ok()?;
        // "[2/3] " before STEP: the stage; otherwise the only (last) one.
        let s = stage
            .trim()
            .strip_prefix('[')
            .and_then(|s| s.split('/').next())
            .and_then(|s| s.parse::<usize>().ok());
        Some((s, n))
    })?;
    let stage = match line.0 {
        Some(s) => stages.get(s.checked_sub(1)?)?,
        None => stages.last()?,
    };
    stage.get(line.1.checked_sub(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_buildah_steps_to_lines() {
        let df = "# syntax\n\nFROM a AS b\nRUN x \\\n  && y\n\nENV A=b\nFROM c\n# c\nRUN false\n";
        let s = stages(df);
        assert_eq!(s.len(), 2);
        assert_eq!(
            s[0][1],
            Instruction {
                line: 4,
                text: "RUN x && y".into()
            }
        );
        let log = |l: &str| vec!["noise".to_string(), l.to_string(), "error".to_string()];
        assert_eq!(
            failed_step(&s, &log("[2/2] STEP 2/2: RUN false"))
                .unwrap()
                .line,
            10
        );
        assert_eq!(
            failed_step(&s, &log("[1/2] STEP 3/3: ENV A=b"))
                .unwrap()
                .line,
            7
        );
        assert_eq!(
            failed_step(&s, &log("STEP 2/2: RUN false")).unwrap().line,
            10
        );
        assert!(failed_step(&s, &log("STEP 9/9: RUN")).is_none());
    }
}
