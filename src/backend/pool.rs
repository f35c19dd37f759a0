//! The KV page pool: counted pages of `Backend::PAGE_TOKENS` positions, and the prefix cache of whole
//! pages under the keys of their tokens (the module doc of `backend` says how `Streams` uses them).

use std::collections::{BTreeMap, HashMap};

use crate::status::Result;
use crate::{bail, err};

/// The key before a stream's first page: the root of every chain.
pub(super) const ROOT: u64 = 0;

/// A whole page in the prefix cache: its tokens after the node of the page before it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PageKey {
    parent: u64,
    tokens: Box<[u32]>,
}

/// A page entered in the prefix cache.
#[derive(Debug)]
struct Cached {
    key: PageKey,
    /// Its node: the parent of the next page's key. Never reused, so a key names one chain.
    node: u64,
    /// Its place in the eviction order while no stream holds it.
    released: Option<u64>,
}

/// The prefix cache's pages: by key, by page, and those no stream holds in the order they were released.
#[derive(Debug, Default)]
struct PrefixCache {
    index: HashMap<PageKey, u32>,
    pages: HashMap<u32, Cached>,
    /// Release tick -> page, for pages no stream holds: the first is evicted first.
    unheld: BTreeMap<u64, u32>,
    next_node: u64,
    clock: u64,
}

impl PrefixCache {
    /// Takes `page` out of the cache (it is about to be written, or reused for other positions).
    fn remove(&mut self, page: u32) {
        if let Some(c) = self.pages.remove(&page) {
            self.index.remove(&c.key);
            if let Some(t) = c.released {
                self.unheld.remove(&t);
            }
        }
    }
}

/// The pool's pages by state, for `engine_kv_usage`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Pages no stream holds (the cache's among them).
    pub free: usize,
    /// Pages more than one stream holds.
    pub shared: usize,
    /// Pages the prefix cache keeps that no stream holds.
    pub cached: usize,
}

/// The page ids of one KV pool: how many streams hold each, which are free, which the prefix cache
/// keeps, and how many positions a page holds.
#[derive(Debug)]
pub struct PagePool {
    page_tokens: usize,
    total: usize,
    /// Free page ids outside the cache; the next page taken is the last one.
    free: Vec<u32>,
    /// Streams holding each page.
    refs: Vec<u32>,
    /// None when the prefix cache is off.
    cache: Option<PrefixCache>,
}

impl PagePool {
    /// `pages` pages of `page_tokens` positions, all free, no prefix cache; NO_ROOM where the host cannot
    /// hold the lists.
    pub fn new(page_tokens: usize, pages: usize) -> Result<PagePool> {
        if page_tokens == 0 {
            bail!(InvalidArgument, "a KV page of 0 tokens");
        }
        if pages > u32::MAX as usize {
            bail!(NoRoom, "a KV pool of {pages} pages is more than page ids count");
        }
        let no_room = |_| err!(NoRoom, "the host has no room for a list of {pages} pages");
        let mut free = Vec::new();
        free.try_reserve_exact(pages).map_err(no_room)?;
        // Reversed, so pages are taken in id order from a fresh pool.
        free.extend((0..pages as u32).rev());
        let mut refs = Vec::new();
        refs.try_reserve_exact(pages).map_err(no_room)?;
        refs.resize(pages, 0);
        Ok(PagePool { page_tokens, total: pages, free, refs, cache: None })
    }

    /// Keeps whole pages for the prefix cache (`on`), or not (the pages it kept are free again).
    pub fn set_prefix_cache(&mut self, on: bool) {
        if !on {
            if let Some(c) = self.cache.take() {
                for p in c.unheld.into_values() {
                    self.free.push(p);
                }
            }
        } else if self.cache.is_none() {
            self.cache = Some(PrefixCache { next_node: ROOT + 1, ..PrefixCache::default() });
        }
    }

    /// Whether whole pages are kept for the prefix cache.
    pub fn caching(&self) -> bool {
        self.cache.is_some()
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    pub fn total_pages(&self) -> usize {
        self.total
    }

    /// Pages no stream holds: free ones and those the prefix cache keeps, which a step takes when it
    /// needs room.
    pub fn free_pages(&self) -> usize {
        self.free.len() + self.cache.as_ref().map_or(0, |c| c.unheld.len())
    }

    /// Pages a stream of `tokens` positions holds.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// Streams holding `page`.
    pub fn refs(&self, page: u32) -> u32 {
        self.refs[page as usize]
    }

    /// `n` pages no stream holds, each now held once, or None (and nothing taken) when fewer are free.
    /// Free pages go first, then the prefix cache's, least recently released first.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free_pages() {
            return None;
        }
        let keep = self.free.len().saturating_sub(n);
        let mut pages = self.free.split_off(keep);
        if let Some(c) = self.cache.as_mut() {
            while pages.len() < n {
                let (_, page) = c.unheld.pop_first().expect("counted in free_pages");
                let key = c.pages.remove(&page).expect("an unheld cached page is entered").key;
                c.index.remove(&key);
                pages.push(page);
            }
        }
        for &p in &pages {
            self.refs[p as usize] = 1;
        }
        Some(pages)
    }

    /// One more holder of `page`, which a stream holds or the prefix cache keeps.
    pub fn hold(&mut self, page: u32) {
        let refs = &mut self.refs[page as usize];
        if *refs == 0 {
            let c = self.cache.as_mut().expect("a page nobody holds is held again only from the cache");
            let t = c.pages.get_mut(&page).and_then(|e| e.released.take()).expect("an unheld cached page");
            c.unheld.remove(&t);
        }
        *refs += 1;
    }

    /// Gives back one hold of each page, the last first: a page nobody holds any more is free again, or
    /// kept by the prefix cache when entered there (a stream's last pages then go before its first).
    pub fn give_back(&mut self, pages: impl IntoIterator<Item = u32>) {
        let pages: Vec<u32> = pages.into_iter().collect();
        for &p in pages.iter().rev() {
            let refs = &mut self.refs[p as usize];
            assert!(*refs > 0, "page {p} was given back more often than it was held");
            *refs -= 1;
            if *refs > 0 {
                continue;
            }
            let kept = match self.cache.as_mut() {
                Some(c) => match c.pages.get_mut(&p) {
                    Some(entry) => {
                        c.clock += 1;
                        entry.released = Some(c.clock);
                        c.unheld.insert(c.clock, p);
                        true
                    }
                    None => false,
                },
                None => false,
            };
            if !kept {
                self.free.push(p);
            }
        }
    }

    /// The page entered under `tokens` after `parent`, with its node.
    pub(super) fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<(u64, u32)> {
        let c = self.cache.as_ref()?;
        let key = PageKey { parent, tokens: tokens.into() };
        let page = *c.index.get(&key)?;
        Some((c.pages[&page].node, page))
    }

    /// Enters `page` (held, whole, holding `tokens` after `parent`) and returns its node; where another
    /// page is entered under the same key, that page's node (this one stays out).
    pub(super) fn enter(&mut self, page: u32, parent: u64, tokens: &[u32]) -> u64 {
        let c = self.cache.as_mut().expect("entered only while caching");
        let key = PageKey { parent, tokens: tokens.into() };
        if let Some(&there) = c.index.get(&key) {
            return c.pages[&there].node;
        }
        if let Some(e) = c.pages.get(&page) {
            // Entered under another key: not possible for a page a stream may write (`admit` takes it out).
            debug_assert_eq!(e.key, key, "page {page} is entered under another key");
            return e.node;
        }
        let node = c.next_node;
        c.next_node += 1;
        c.index.insert(key.clone(), page);
        c.pages.insert(page, Cached { key, node, released: None });
        node
    }

    /// Takes `page`, which one stream holds and is about to write, out of the prefix cache.
    pub(super) fn forget(&mut self, page: u32) {
        if let Some(c) = self.cache.as_mut() {
            c.remove(page);
        }
    }

    /// The pages by state.
    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            free: self.free_pages(),
            shared: self.refs.iter().filter(|&&r| r > 1).count(),
            cached: self.cache.as_ref().map_or(0, |c| c.unheld.len()),
        }
    }

    /// Checks the counts against the pages `holders` hold (each stream's list): every page is held by
    /// exactly its count of streams, a held page is neither free nor waiting in the cache, every page
    /// is accounted for once, and the cache's index and pages agree. The first discrepancy, in words.
    pub fn audit<'p>(&self, holders: impl IntoIterator<Item = &'p [u32]>) -> std::result::Result<(), String> {
        let mut counted = vec![0u32; self.total];
        for pages in holders {
            for &p in pages {
                *counted.get_mut(p as usize).ok_or_else(|| format!("page {p} is outside the pool"))? += 1;
            }
        }
        if let Some(p) = (0..self.total).find(|&p| counted[p] != self.refs[p]) {
            return Err(format!("page {p}: {} holders, counted {}", counted[p], self.refs[p]));
        }
        let mut seen = vec![false; self.total];
        let unheld: Vec<u32> = self.cache.as_ref().map_or(Vec::new(), |c| c.unheld.values().copied().collect());
        for &p in self.free.iter().chain(&unheld) {
            if std::mem::replace(&mut seen[p as usize], true) {
                return Err(format!("page {p} is listed free twice"));
            }
            if counted[p as usize] > 0 {
                return Err(format!("page {p} is free while {} streams hold it", counted[p as usize]));
            }
        }
        if let Some(p) = (0..self.total).find(|&p| !seen[p] && counted[p] == 0) {
            return Err(format!("page {p} is neither held nor free"));
        }
        let Some(c) = self.cache.as_ref() else { return Ok(()) };
        if c.index.len() != c.pages.len() {
            return Err(format!("{} keys for {} cached pages", c.index.len(), c.pages.len()));
        }
        for (&p, e) in &c.pages {
            if c.index.get(&e.key) != Some(&p) {
                return Err(format!("cached page {p} is not found under its key"));
            }
            if e.released.is_some() != (counted[p as usize] == 0) {
                return Err(format!("cached page {p}: released {:?} with {} holders", e.released, counted[p as usize]));
            }
            if e.key.tokens.len() != self.page_tokens {
                return Err(format!("cached page {p} is keyed by {} tokens", e.key.tokens.len()));
            }
        }
        if let Some((_, &p)) = c.unheld.iter().find(|&(&t, p)| c.pages.get(p).and_then(|e| e.released) != Some(t)) {
            return Err(format!("page {p} waits in the cache's order under another tick"));
        }
        Ok(())
    }
}
