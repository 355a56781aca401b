package scheduler

import (
	"errors"
	"sort"
	"time"
)

// Job is a unit of work that should run at a given time.
type Job struct {
	Name     string
	RunAt    time.Time
	Priority int
	Done     bool
}

type Scheduler struct {
	jobs []*Job
}

func New() *Scheduler {
	return &Scheduler{}
}

func (s *Scheduler) Add(name string, runAt time.Time, priority int) error {
	for _, j := range s.jobs {
		if j.Name == name {
			return errors.New("job already scheduled: " + name)
		}
	}
	s.jobs = append(s.jobs, &Job{Name: name, RunAt: runAt, Priority: priority})
	return nil
}

func (s *Scheduler) Due(now time.Time) []*Job {
	var due []*Job
	for _, j := range s.jobs {
		if !j.Done && j.RunAt.Before(now) {
			due = append(due, j)
		}
	}
	sort.Slice(due, func(a, b int) bool {
		return due[a].Priority < due[b].Priority
	})
	return due
}

func (s *Scheduler) MarkDone(name string) bool {
	for _, j := range s.jobs {
		if j.Name == name {
			j.Done = true
			return true
		}
	}
	return false
}

func (s *Scheduler) Pending() int {
	n := 0
	for _, j := range s.jobs {
		if !j.Done {
			n++
		}
	}
	return n
}
